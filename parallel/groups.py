"""Process groups of the trainer (DP x TP x PP) from the planner's rank map.

Plan schema (written by the planner):
    world_size: int
    ranks: [{rank, role: "rollout" | "train", dp, tp, pp, layers: [start, end)}]   (coordinates for train ranks)
    train: {dp, tp, pp, stages: [{pp, gpu_type, layers: [start, end), ranks: [global ranks]}]}

Train-rank order: the train ranks sorted by global rank; train index i -> tp = i % tp, dp = (i // tp) % dp,
pp = i // (tp * dp). TP is fastest varying so a TP group sits on neighbouring (same-node) ranks.

`build_groups` is collective: dist.new_group must be called by every world rank, in the same order, with the
same arguments -- rollout ranks call it too and simply get role "rollout".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from parallel.rankmap import PlanError


@dataclass
class ParallelGroups:
    role: str
    rank: int
    world_size: int
    train_ranks: list[int]
    rollout_ranks: list[int]
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
    pp_ranks: list[int] = field(default_factory=list)     # global ranks of my pipeline, by stage
    dp_ranks: list[int] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)

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


def train_coords(index: int, dp: int, tp: int) -> tuple[int, int, int]:
    """train index -> (dp_rank, tp_rank, pp_rank)"""
    return (index // tp) % dp, index % tp, index // (tp * dp)


def validate_plan(plan: dict) -> tuple[list[int], list[int], int, int, int, list[tuple[int, int]]]:
    """Checks the rank map; returns (train_ranks, rollout_ranks, dp, tp, pp, stage_layers)."""
    try:
        world = int(plan["world_size"])
        entries = plan["ranks"]
        dp, tp, pp = (int(plan["train"][k]) for k in ("dp", "tp", "pp"))
        stages = plan["train"]["stages"]
    except (KeyError, TypeError) as e:
        raise PlanError(f"plan is missing field {e}; needs world_size, ranks, train.dp/tp/pp/stages") from None
    if min(dp, tp, pp) < 1:
        raise PlanError(f"plan train sizes must be >= 1, got dp={dp} tp={tp} pp={pp}")
    by_rank = {int(e["rank"]): e for e in entries}
    if sorted(by_rank) != list(range(world)):
        raise PlanError(f"plan ranks must list every rank 0..{world - 1} exactly once, got {sorted(by_rank)}")
    roles = {r: e.get("role") for r, e in by_rank.items()}
    bad = {r: x for r, x in roles.items() if x not in ("train", "rollout")}
    if bad:
        raise PlanError(f"plan rank roles must be 'train' or 'rollout', got {bad}")
    train_ranks = [r for r in range(world) if roles[r] == "train"]
    rollout_ranks = [r for r in range(world) if roles[r] == "rollout"]
    if len(train_ranks) != dp * tp * pp:
        raise PlanError(f"plan has {len(train_ranks)} train ranks but dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp}")
    if len(stages) != pp:
        raise PlanError(f"plan train.stages has {len(stages)} entries, expected pp={pp}")
    stages = sorted(stages, key=lambda s: int(s["pp"]))
    stage_layers = [(int(s["layers"][0]), int(s["layers"][1])) for s in stages]
    start = 0
    for s, (a, b) in enumerate(stage_layers):
        if a != start or b <= a:
            raise PlanError(f"plan stage layers must be contiguous, non-empty and start at 0; got {stage_layers}")
        start = b
    for i, r in enumerate(train_ranks):
        d, t, p = train_coords(i, dp, tp)
        e = by_rank[r]
        got = (e.get("dp"), e.get("tp"), e.get("pp"))
        if got != (d, t, p):
            raise PlanError(f"plan rank {r} has (dp,tp,pp)={got}, but train index {i} implies {(d, t, p)} "
                            f"(tp fastest, then dp, then pp)")
        if "layers" in e and tuple(e["layers"]) != stage_layers[p]:
            raise PlanError(f"plan rank {r} layers {e['layers']} differ from stage {p} layers {stage_layers[p]}")
        if "ranks" in stages[p] and r not in stages[p]["ranks"]:
            raise PlanError(f"plan rank {r} is pp stage {p} but not listed in train.stages[{p}].ranks")
    return train_ranks, rollout_ranks, dp, tp, pp, stage_layers


def build_groups(plan: dict) -> ParallelGroups:
    """COLLECTIVE over the world group. Creates train/DP/TP/PP/embedding groups; returns this rank's view."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups: torch.distributed is not initialised (call dist.init_process_group first)")
    train_ranks, rollout_ranks, dp, tp, pp, stage_layers = validate_plan(plan)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != int(plan["world_size"]):
        raise PlanError(f"plan world_size={plan['world_size']} but torch.distributed world size is {world}")
    g = ParallelGroups(role="train" if rank in train_ranks else "rollout", rank=rank, world_size=world,
                       train_ranks=train_ranks, rollout_ranks=rollout_ranks, dp=dp, tp=tp, pp=pp,
                       stage_layers=stage_layers)
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
    return g


def make_train_plan(dp: int, tp: int, pp: int, stage_layers: list[tuple[int, int]], world_size: int | None = None,
                    gpu_type: str = "cpu") -> dict:
    """A plan with the train ranks first (0 .. dp*tp*pp-1) and any remaining ranks as rollout (tests, benches)."""
    n_train = dp * tp * pp
    world_size = n_train if world_size is None else world_size
    if world_size < n_train:
        raise PlanError(f"world_size {world_size} < dp*tp*pp = {n_train}")
    ranks: list[dict] = []
    for r in range(world_size):
        if r < n_train:
            d, t, p = train_coords(r, dp, tp)
            ranks.append({"rank": r, "role": "train", "dp": d, "tp": t, "pp": p, "layers": list(stage_layers[p])})
        else:
            ranks.append({"rank": r, "role": "rollout"})
    stages = [{"pp": p, "gpu_type": gpu_type, "layers": list(stage_layers[p]),
               "ranks": [r for r in range(n_train) if train_coords(r, dp, tp)[2] == p]} for p in range(pp)]
    return {"world_size": world_size, "ranks": ranks, "train": {"dp": dp, "tp": tp, "pp": pp, "stages": stages}}
