"""Rank maps: which global rank generates and which trains, and where it sits in the trainer's mesh.

The schema is the one schedule.py writes (see README, "Plan JSON"): `world_size`, `ranks` (per global
rank: `rank`, `role` rollout|train, for train `dp`, `tp`, `pp`, `layers`), `rollout.replicas` and
`train` (`dp`, `tp`, `pp`, `stages`: [{pp, gpu_type, layers, ranks}]). Train-rank order: the train ranks
sorted by global rank; train index i -> tp = i % tp, dp = (i // tp) % dp, pp = i // (tp * dp). TP is fastest
varying so a TP group sits on neighbouring (same-node) ranks.
Without a plan file, `default_plan` splits the world: the first ranks train (data parallel only),
the rest generate.
"""

from __future__ import annotations

import json
from pathlib import Path

from errors import HexrlError


class PlanError(HexrlError, ValueError):
    """The plan is unusable (unreadable, inconsistent, or infeasible); the message names the problem."""

    same_on_every_rank = True


def stage_layer_ranges(num_layers: int, pp: int) -> list[list[int]]:
    base, extra = divmod(num_layers, pp)
    bounds, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        bounds.append([start, end])
        start = end
    return bounds


def default_plan(world_size: int, num_layers: int, num_rollout: int = 0) -> dict:
    if world_size < 2:
        raise PlanError(f"hexrl needs at least 2 ranks (one rollout, one train), got world size {world_size}")
    n_roll = num_rollout or world_size // 2
    if not 1 <= n_roll < world_size:
        raise PlanError(f"plan.num_rollout={num_rollout} leaves no rollout or no train rank in a world of {world_size}")
    n_train = world_size - n_roll
    return make_train_plan(n_train, 1, 1, [(0, num_layers)], world_size=world_size)


def load_plan(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise PlanError(f"plan file '{path}' does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"plan file '{path}' is not valid JSON: {e}") from None


def check_plan(plan: dict, world_size: int, num_layers: int) -> None:
    """The plan must fit this launch and this model; the rest of its consistency is checked by
    validate_plan (roles, layout sizes, coordinates, stage contiguity)."""
    n = plan.get("world_size")
    if n != world_size:
        raise PlanError(f"rank map is for world_size={n} but torchrun started {world_size} ranks")
    train, rollout, dp, tp, pp, stage_layers = validate_plan(plan)
    if not train or not rollout:
        raise PlanError(f"rank map needs at least one train and one rollout rank (train={train}, rollout={rollout})")
    if stage_layers[-1][1] != num_layers:
        raise PlanError(
            f"rank map stages cover layers 0..{stage_layers[-1][1] - 1} but the model has {num_layers} layers"
        )


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
    for a, b in stage_layers:
        if a != start or b <= a:
            raise PlanError(f"plan stage layers must be contiguous, non-empty and start at 0; got {stage_layers}")
        start = b
    for i, r in enumerate(train_ranks):
        d, t, p = train_coords(i, dp, tp)
        e = by_rank[r]
        got = (e.get("dp"), e.get("tp"), e.get("pp"))
        if got != (d, t, p):
            raise PlanError(
                f"plan rank {r} has (dp,tp,pp)={got}, but train index {i} implies {(d, t, p)} "
                f"(tp fastest, then dp, then pp)"
            )
        if "layers" in e and tuple(e["layers"]) != stage_layers[p]:
            raise PlanError(f"plan rank {r} layers {e['layers']} differ from stage {p} layers {stage_layers[p]}")
        if "ranks" in stages[p] and r not in stages[p]["ranks"]:
            raise PlanError(f"plan rank {r} is pp stage {p} but not listed in train.stages[{p}].ranks")
    return train_ranks, rollout_ranks, dp, tp, pp, stage_layers


def make_train_plan(
    dp: int, tp: int, pp: int, stage_layers: list[tuple[int, int]], world_size: int | None = None, gpu_type: str = "cpu"
) -> dict:
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
    stages = [
        {
            "pp": p,
            "gpu_type": gpu_type,
            "layers": list(stage_layers[p]),
            "ranks": [r for r in range(n_train) if train_coords(r, dp, tp)[2] == p],
        }
        for p in range(pp)
    ]
    return {"world_size": world_size, "ranks": ranks, "train": {"dp": dp, "tp": tp, "pp": pp, "stages": stages}}
