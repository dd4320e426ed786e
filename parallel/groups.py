"""Process groups from the planner's rank map: the trainer's DP x TP x PP mesh and the rollout replicas.

The plan's schema, its validation and the train-rank order are parallel/rankmap.py's. Rollout ranks form
replicas (`rollout.replicas`: ranks, tp, share): a TP-k replica is k ranks of one machine running one sharded
generator; its leader (lowest rank) is the one the train head talks to, so `rollout_ranks` lists the leaders.
A plan without `rollout.replicas` makes every rollout rank a TP-1 replica of equal share. Ranks the plan marks
`idle` join every group and otherwise wait for the end of the run.

`build_groups` is collective: dist.new_group must be called by every world rank, in the same order, with the
same arguments -- rollout ranks call it too and simply get role "rollout".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from parallel.rankmap import PlanError, train_coords, validate_plan


@dataclass
class RolloutReplica:
    id: int
    ranks: list[int]  # leader first
    share: float  # the planned fraction of generated tokens
    group: Any = None  # process group of its ranks (tp > 1)

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        return self.ranks[0]


def rollout_replicas(plan: dict, rollout_ranks: list[int]) -> tuple[list[RolloutReplica], list[int]]:
    """The plan's rollout replicas (checked against its rollout ranks) and its idle ranks."""
    entries = {int(e["rank"]): e for e in plan["ranks"]}
    idle = [r for r in rollout_ranks if entries[r].get("idle")]
    specs = (plan.get("rollout") or {}).get("replicas")
    if not specs:
        live = [r for r in rollout_ranks if r not in idle]
        return [RolloutReplica(i, [r], 1.0 / len(live)) for i, r in enumerate(live)], idle  # [] without any
    replicas, seen = [], set()
    for spec in specs:
        ranks = sorted(int(r) for r in spec["ranks"])
        if int(spec.get("pp", 1)) != 1:
            raise PlanError(
                f"rollout replica {spec.get('id')} has pp={spec['pp']}: rollout replicas run TP only (pp 1)"
            )
        if int(spec.get("tp", len(ranks))) != len(ranks):
            raise PlanError(f"rollout replica {spec.get('id')} has tp={spec['tp']} but {len(ranks)} ranks {ranks}")
        bad = [r for r in ranks if r not in rollout_ranks or r in idle or r in seen]
        if bad:
            raise PlanError(f"rollout replica {spec.get('id')} lists ranks {bad} that are not free rollout ranks")
        machines = {entries[r].get("machine") for r in ranks}
        if len(machines) > 1:
            raise PlanError(f"rollout replica {spec.get('id')} spans machines {sorted(machines)}; TP stays on one")
        seen.update(ranks)
        replicas.append(RolloutReplica(int(spec.get("id", len(replicas))), ranks, float(spec.get("share", 0.0))))
    missing = [r for r in rollout_ranks if r not in seen and r not in idle]
    if missing:
        raise PlanError(f"rollout ranks {missing} are in no replica and not idle")
    total = sum(r.share for r in replicas)
    for r in replicas:  # shares that do not sum to 1 (or are missing) are read as relative weights
        r.share = r.share / total if total > 0 else 1.0 / len(replicas)
    return replicas, idle


@dataclass
class ParallelGroups:
    role: str  # train | rollout | idle
    rank: int
    world_size: int
    train_ranks: list[int]
    rollout_ranks: list[int]  # the replica leaders: the ranks the train head talks to
    dp: int
    tp: int
    pp: int
    stage_layers: list[tuple[int, int]]
    dp_rank: int = -1
    tp_rank: int = -1
    pp_rank: int = -1
    train_group: Any = None
    dp_group: Any = None
    tp_group: Any = None
    pp_group: Any = None
    # first and last PP stage with the same (dp, tp): sums the grads of tied input/output embeddings
    embedding_group: Any = None
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of my pipeline, by stage
    dp_ranks: list[int] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)
    replicas: list[RolloutReplica] = field(default_factory=list)
    idle_ranks: list[int] = field(default_factory=list)
    replica: RolloutReplica | None = None  # this rank's replica (rollout ranks)

    @property
    def is_train(self) -> bool:
        return self.role == "train"

    @property
    def is_train_head(self) -> bool:
        return self.is_train and self.rank == self.train_ranks[0]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def layers(self) -> tuple[int, int]:
        return self.stage_layers[self.pp_rank]


def build_groups(plan: dict) -> ParallelGroups:
    """COLLECTIVE over the world group. Creates train/DP/TP/PP/embedding groups; returns this rank's view."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups: torch.distributed is not initialised (call dist.init_process_group first)")
    train_ranks, rollout_ranks, dp, tp, pp, stage_layers = validate_plan(plan)
    replicas, idle = rollout_replicas(plan, rollout_ranks)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != int(plan["world_size"]):
        raise PlanError(f"plan world_size={plan['world_size']} but torch.distributed world size is {world}")
    g = ParallelGroups(
        role="train" if rank in train_ranks else "idle" if rank in idle else "rollout",
        rank=rank,
        world_size=world,
        train_ranks=train_ranks,
        rollout_ranks=[r.leader for r in replicas],
        dp=dp,
        tp=tp,
        pp=pp,
        stage_layers=stage_layers,
        replicas=replicas,
        idle_ranks=idle,
    )
    index = {r: i for i, r in enumerate(train_ranks)}

    def at(d: int, t: int, p: int) -> int:
        return train_ranks[p * tp * dp + d * tp + t]

    # every rank creates every group in the same order; a rank keeps the handles of the groups it belongs to
    g.train_group = dist.new_group(train_ranks)
    if g.is_train:
        g.dp_rank, g.tp_rank, g.pp_rank = train_coords(index[rank], dp, tp)
    for p in range(pp):
        for d in range(dp):
            ranks = [at(d, t, p) for t in range(tp)]
            grp = dist.new_group(ranks)
            if rank in ranks:
                g.tp_group, g.tp_ranks = grp, ranks
    for p in range(pp):
        for t in range(tp):
            ranks = [at(d, t, p) for d in range(dp)]
            grp = dist.new_group(ranks)
            if rank in ranks:
                g.dp_group, g.dp_ranks = grp, ranks
    for d in range(dp):
        for t in range(tp):
            ranks = [at(d, t, p) for p in range(pp)]
            grp = dist.new_group(ranks)
            if rank in ranks:
                g.pp_group, g.pp_ranks = grp, ranks
            if pp > 1:
                ends = [ranks[0], ranks[-1]]
                grp = dist.new_group(ends)
                if rank in ends:
                    g.embedding_group = grp
    for replica in replicas:
        if replica.tp > 1:
            replica.group = dist.new_group(replica.ranks)
        if rank in replica.ranks:
            g.replica = replica
    return g
