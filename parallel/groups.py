"""Process groups from the planner's rank map: the trainer's DP x TP x PP mesh and the rollout replicas.

The plan's schema, its validation and the train-rank order are plan.py's. Rollout ranks form
replicas (`rollout.replicas`: ranks, tp, share): a TP-k replica is k ranks of one machine running one sharded
generator; its leader (lowest rank) is the one the train head talks to, so `rollout_ranks` lists the leaders.
A plan without `rollout.replicas` makes every rollout rank a TP-1 replica of equal share. Ranks the plan marks
`idle` join every group and otherwise wait for the end of the run.

`build_groups` is collective: dist.new_group must be called by every world rank, in the same order, with the
same arguments -- rollout ranks call it too and simply get role "rollout".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel.sync_layout import links_from_cluster
from plan import PlanError, RolloutReplica, rollout_replicas, train_coords, validate_plan


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
    # weight sync (parallel/weight_sync.py): ("owners", leader) -> {all owners} + {leader}; (a, b) -> the pair of
    # replica leaders a < b on one machine. Every link its own group: a dead peer fails only its own links.
    weight_links: dict = field(default_factory=dict)
    owner_ranks: list[list[int]] = field(default_factory=list)  # [stage][dp] -> that replica's tp-0 rank of the stage
    machine_of: dict[int, int] = field(default_factory=dict)  # rank -> the plan's machine
    link_gbps: Any = None  # (machine, machine) -> GB/s, from the plan's cluster (1.0 everywhere without one)

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

    def what_runs(self) -> dict:
        """This rank's role as these groups run it, spelt like plan.planned_role (for layout.json)."""
        train, replica = self.is_train, self.replica if self.role == "rollout" else None
        return {
            "role": self.role,
            "replica": replica.id if replica else None,
            "tp_rank": replica.ranks.index(self.rank) if replica else None,
            "stage": self.pp_rank if train else None,
            "dp": self.dp_rank if train else None,
            "tp": self.tp_rank if train else None,
        }


def build_groups(plan: dict, mate_timeout_s: float | None = None) -> ParallelGroups:
    """COLLECTIVE over the world group. Creates train/DP/TP/PP/embedding groups, the rollout replicas' and the
    weight-sync links; returns this rank's view. `mate_timeout_s`: the timeout of the links between replica leaders
    of one machine (a leader whose relay died gives up on it after this; None: the default process-group one)."""
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
    g.owner_ranks = [[at(d, 0, p) for d in range(dp)] for p in range(pp)]
    g.machine_of = {int(e["rank"]): int(e.get("machine") or 0) for e in plan["ranks"]}
    cluster = (plan.get("inputs") or {}).get("cluster")
    g.link_gbps = links_from_cluster(cluster).gbps if cluster else lambda a, b: 1.0
    owners = {r for per_stage in g.owner_ranks for r in per_stage}
    for replica in replicas:
        ranks = sorted(owners | {replica.leader})
        grp = dist.new_group(ranks)
        if rank in ranks:
            g.weight_links[("owners", replica.leader)] = grp
    kwargs = {} if mate_timeout_s is None else {"timeout": timedelta(seconds=mate_timeout_s)}
    for a in replicas:
        for b in replicas:
            if a.leader < b.leader and a.machine == b.machine:
                grp = dist.new_group([a.leader, b.leader], **kwargs)
                if rank in (a.leader, b.leader):
                    g.weight_links[(a.leader, b.leader)] = grp
    return g
