"""The plan JSON, where the planner and the runtime meet: which global rank generates and which trains, where it
sits in the trainer's mesh, and checks that a launch runs it. Torch-free but for the checks' gathers.

The schema is the one schedule.py writes (docs/planner.md, "Plan JSON"): `world_size`, `ranks` (per global
rank: `rank`, `role` rollout|train, for train `dp`, `tp`, `pp`, `layers`), `rollout.replicas` and
`train` (`dp`, `tp`, `pp`, `stages`: [{pp, gpu_type, layers, ranks}]). Train-rank order: the train ranks
sorted by global rank; train index i -> tp = i % tp, dp = (i // tp) % dp, pp = i // (tp * dp). TP is fastest
varying so a TP group sits on neighbouring (same-node) ranks.
Without a plan file, `default_plan` splits the world: the first ranks train (data parallel only),
the rest generate.
Placement (below): the plan's machines are torchrun's nodes in rank order; `check_launch` (collective) checks every
rank's node, local rank and device against the plan and returns the layout the head writes as layout.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class RolloutReplica:
    id: int
    ranks: list[int]  # leader first
    share: float  # the planned fraction of generated tokens
    group: Any = None  # process group of its ranks (tp > 1)
    machine: int = 0  # the plan's machine index (weight sync sends one copy per machine)

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
        machine = {r: int(entries[r].get("machine", 0)) for r in live}
        return [RolloutReplica(i, [r], 1.0 / len(live), machine=machine[r]) for i, r in enumerate(live)], idle
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
        replicas.append(
            RolloutReplica(
                int(spec.get("id", len(replicas))),
                ranks,
                float(spec.get("share", 0.0)),
                machine=int(machines.pop() or 0),
            )
        )
    missing = [r for r in rollout_ranks if r not in seen and r not in idle]
    if missing:
        raise PlanError(f"rollout ranks {missing} are in no replica and not idle")
    total = sum(r.share for r in replicas)
    for r in replicas:  # shares that do not sum to 1 (or are missing) are read as relative weights
        r.share = r.share / total if total > 0 else 1.0 / len(replicas)
    return replicas, idle


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


# ---------------------------------------------------------------------------------------------- placement
# Where the plan puts each rank vs where torchrun started it. The mapping:
#   * the plan's nodes are its machines (`ranks[].machine`, the cluster YAML's index) in order of first appearance
#     along the global ranks; node k of the plan is the k-th of them (not necessarily YAML machine k: schedule.py
#     puts the machines holding pipeline stage 0 first);
#   * each machine's ranks must be one contiguous block of global ranks (torchrun gives a node one block);
#   * torchrun's node GROUP_RANK = k must run exactly that machine's ranks: LOCAL_WORLD_SIZE = the machine's rank
#     count, and local rank j is the machine's j-th rank, i.e. RANK = first rank of machine k + LOCAL_RANK. Nodes may
#     run different numbers of ranks; the offsets come from the plan's per-machine counts;
#   * the device matches the rank's `gpu_type` (`device_matches`): "cpu" runs on CPU only, a GPU type on a CUDA
#     device whose name contains it, an emulated type (an `emulate` entry in the plan's cluster) on CPU. HEXRL_ANY_DEVICE=1 in the environment skips this comparison on purpose (a GPU
#     cluster's plan rehearsed on CPU, or a GPU whose name the type does not spell).
# With c10d rendezvous torchrun orders nodes by (host name, agent pid), whatever --node_rank says, so the check is
# what turns a launch in the wrong node order into one clear error instead of ranks doing the wrong machine's work.
# Plans without `machine` fields (default_plan, make_train_plan) say nothing about placement: nothing to check but
# the device of ranks that carry a `gpu_type`.

ANY_DEVICE_ENV = "HEXRL_ANY_DEVICE"


def plan_nodes(plan: dict) -> list[dict] | None:
    """The plan's machines in node order: [{"machine", "gpu_type", "first", "count"}] (ranks first .. first+count-1);
    None when the plan has no `machine` fields. PlanError if a machine's ranks are not one contiguous block."""
    entries = sorted(plan["ranks"], key=lambda e: int(e["rank"]))
    have = [e for e in entries if "machine" in e]
    if not have:
        return None
    if len(have) != len(entries):
        missing = [int(e["rank"]) for e in entries if "machine" not in e]
        raise PlanError(f"plan ranks {missing} have no `machine` while others do")
    nodes: list[dict] = []
    for e in entries:
        r, m = int(e["rank"]), e["machine"]
        if nodes and nodes[-1]["machine"] == m:
            nodes[-1]["count"] += 1
            continue
        if any(n["machine"] == m for n in nodes):
            ranks = [int(x["rank"]) for x in entries if x["machine"] == m]
            raise PlanError(
                f"plan machine {m} holds ranks {ranks}, not one contiguous block: torchrun gives each node "
                "a contiguous range of global ranks"
            )
        nodes.append({"machine": m, "gpu_type": e.get("gpu_type"), "first": r, "count": 1})
    return nodes


def device_name(device) -> str:
    """What `device_matches` compares a plan's gpu_type with: "cpu", or the CUDA device's name."""
    if device.type == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(device)


def device_matches(gpu_type: str, name: str) -> bool:
    """Plan type "cpu" matches only "cpu"; a GPU type matches a device name that contains it as a whole word,
    case-insensitive ("H800" ~ "NVIDIA H800", "A100" ~ "NVIDIA A100-SXM4-80GB"; "H20" is not "NVIDIA H200")."""
    t, n = gpu_type.strip().lower(), name.strip().lower()
    if t == "cpu" or n == "cpu":
        return t == n
    return re.search(rf"(?<![a-z0-9]){re.escape(t)}(?![a-z0-9])", n) is not None


def _placement_problem(
    plan: dict,
    nodes: list[dict] | None,
    rank: int,
    node_rank: int,
    local_rank: int,
    nproc_per_node: int,
    device: str,
    any_device: bool,
) -> str | None:
    where = f"placement: rank {rank} (node {node_rank}, local rank {local_rank})"
    if nodes is not None:
        if not 0 <= node_rank < len(nodes):
            return f"{where}: the plan has {len(nodes)} machine(s) (nodes 0..{len(nodes) - 1}), found node {node_rank}"
        n = nodes[node_rank]
        last = n["first"] + n["count"] - 1
        if nproc_per_node != n["count"]:
            return (
                f"{where}: the plan puts {n['count']} rank(s) (ranks {n['first']}..{last}) on node {node_rank} "
                f"(machine {n['machine']}), found {nproc_per_node} on that node (LOCAL_WORLD_SIZE)"
            )
        if rank != n["first"] + local_rank:
            return (
                f"{where}: the plan gives node {node_rank} (machine {n['machine']}) ranks {n['first']}..{last}, "
                f"so local rank {local_rank} is rank {n['first'] + local_rank}, found rank {rank} (an earlier node "
                "runs a different number of ranks than the plan gives its machine)"
            )
    gpu_type = _entry(plan, rank).get("gpu_type")
    types = ((plan.get("inputs") or {}).get("cluster") or {}).get("gpu_types") or {}
    if (types.get(gpu_type) or {}).get("emulate") and device == "cpu":  # emulated types run on CPU (emulation.py)
        return None
    if gpu_type is not None and not any_device and not device_matches(str(gpu_type), device):
        return (
            f"{where}: the plan expects a {gpu_type} device, found {device!r} (launch it on a {gpu_type} node, "
            f"or set {ANY_DEVICE_ENV}=1 to run the plan on other devices on purpose)"
        )
    return None


def _entry(plan: dict, rank: int) -> dict:
    for e in plan["ranks"]:
        if int(e["rank"]) == rank:
            return e
    raise PlanError(f"plan has no entry for rank {rank}")


def check_placement(
    plan: dict,
    rank: int,
    node_rank: int,
    local_rank: int,
    nproc_per_node: int,
    device_name: str,
    any_device: bool = False,
) -> None:
    """One rank's placement (the mapping above); raises PlanError, one line naming the rank, what the plan
    expects and what was found. nproc_per_node: the ranks torchrun runs on this node (LOCAL_WORLD_SIZE)."""
    problem = _placement_problem(
        plan, plan_nodes(plan), rank, node_rank, local_rank, nproc_per_node, device_name, any_device
    )
    if problem:
        raise PlanError(problem)


def launch_env(env) -> dict:
    """torchrun's placement of this process: rank, node (GROUP_RANK), local_rank, nproc (LOCAL_WORLD_SIZE)."""
    rank = int(env.get("RANK", 0))
    return {
        "rank": rank,
        "node": int(env.get("GROUP_RANK", 0)),
        "local_rank": int(env.get("LOCAL_RANK", rank)),
        "nproc": int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
    }


def planned_role(plan: dict, rank: int) -> dict:
    """What the plan makes of a rank, as layout.json spells it: role train|rollout|idle, replica, tp_rank (rollout:
    the rank's place in its replica, leader 0), stage, dp, tp (train: its pipeline stage and mesh coordinates)."""
    e = _entry(plan, rank)
    out = {"role": e.get("role"), "replica": None, "tp_rank": None, "stage": None, "dp": None, "tp": None}
    if e.get("role") == "train":
        out.update(stage=e.get("pp"), dp=e.get("dp"), tp=e.get("tp"))
        return out
    rollout = [int(x["rank"]) for x in plan["ranks"] if x.get("role") == "rollout"]
    replicas, idle = rollout_replicas(plan, rollout)
    if rank in idle:
        out["role"] = "idle"
    for rep in replicas:
        if rank in rep.ranks:
            out.update(replica=rep.id, tp_rank=rep.ranks.index(rank))
    return out


def layout_record(plan: dict, env, device: str, runs: dict | None = None) -> dict:
    """This rank's entry of runs/<run>/layout.json: rank, role, replica, tp_rank, stage, dp, tp (`runs`: what its
    process groups run, ParallelGroups.what_runs(); before they exist, what the plan makes of it), node,
    local_rank (from torchrun's env) and device (`device_name`)."""
    where = launch_env(env)
    return {
        "rank": where["rank"],
        **(runs if runs is not None else planned_role(plan, where["rank"])),
        "node": where["node"],
        "local_rank": where["local_rank"],
        "device": device,
    }


def layout_mismatches(plan: dict, layout: list[dict], any_device: bool = False) -> list[str]:
    """Every way a gathered layout (one layout_record per global rank, in rank order) differs from the plan, one
    line each; [] when the launch is the plan. A node's rank count is the number of records naming that node."""
    world = int(plan["world_size"])
    if [rec.get("rank") for rec in layout] != list(range(world)):
        return [f"placement: the layout lists ranks {[rec.get('rank') for rec in layout]}, the plan 0..{world - 1}"]
    nodes = plan_nodes(plan)
    per_node: dict[int, int] = {}
    for rec in layout:
        per_node[rec["node"]] = per_node.get(rec["node"], 0) + 1
    out = []
    for rec in layout:
        rank = rec["rank"]
        expected = planned_role(plan, rank)
        got = {k: rec.get(k) for k in expected}
        if got != expected:
            out.append(f"placement: rank {rank}: the plan makes it {expected}, it reported {got} (another plan file?)")
        problem = _placement_problem(
            plan, nodes, rank, rec["node"], rec["local_rank"], per_node[rec["node"]], rec["device"], any_device
        )
        if problem:
            out.append(problem)
    return out


def all_gather_json(obj) -> list:
    """COLLECTIVE over the world group: every rank's JSON document, in rank order (JSON, never pickle)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return [json.loads(bytes(b[: int(s.item())].numpy()).decode()) for b, s in zip(bufs, sizes)]


def check_launch(plan: dict, device, env) -> list[dict]:
    """COLLECTIVE over the world group (call it on every rank, after init_process_group and check_plan, before
    build_groups): gathers every rank's layout_record and checks the whole layout against the plan. Returns the
    layout (for the head to write as runs/<run>/layout.json). On a mismatch every rank raises the same PlanError
    (one line: the first mismatch, and how many more), so no rank is left waiting in a collective; the train
    script prints it once per node (train.exit_on_error)."""
    layout = all_gather_json(layout_record(plan, env, device_name(device)))
    problems = layout_mismatches(plan, layout, any_device=env.get(ANY_DEVICE_ENV) == "1")
    if not problems:
        return layout
    more = f" (and {len(problems) - 1} more mismatch(es))" if len(problems) > 1 else ""
    raise PlanError(problems[0] + more)
