"""Rank maps: which global rank generates and which trains, and where it sits in the trainer's mesh.

The schema is the one schedule.py writes (see README, "Plan JSON"): `world_size`, `ranks` (per global
rank: `rank`, `role` rollout|train, for train `dp`, `tp`, `pp`, `layers`), `rollout.replicas` and
`train` (`dp`, `tp`, `pp`, `stages`). Train-rank order: tp fastest, then dp, then pp.
Without a plan file, `default_plan` splits the world: the first ranks train (data parallel only),
the rest generate.
"""
from __future__ import annotations

import json
from pathlib import Path


class PlanError(ValueError):
    """The plan is unusable (unreadable, inconsistent, or infeasible); the message names the problem."""


def split_layers(num_layers: int, pp: int) -> list[list[int]]:
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
        raise PlanError(f"plan.num_rollout={num_rollout} leaves no rollout or no train rank "
                           f"in a world of {world_size}")
    from parallel.groups import make_train_plan

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
    parallel.groups.validate_plan (roles, layout sizes, coordinates, stage contiguity)."""
    from parallel.groups import validate_plan

    n = plan.get("world_size")
    if n != world_size:
        raise PlanError(f"rank map is for world_size={n} but torchrun started {world_size} ranks")
    train, rollout, dp, tp, pp, stage_layers = validate_plan(plan)
    if not train or not rollout:
        raise PlanError(f"rank map needs at least one train and one rollout rank (train={train}, rollout={rollout})")
    if stage_layers[-1][1] != num_layers:
        raise PlanError(f"rank map stages cover layers 0..{stage_layers[-1][1] - 1} "
                           f"but the model has {num_layers} layers")
