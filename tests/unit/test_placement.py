"""Placement: the plan's machines -> torchrun's nodes (GROUP_RANK), local ranks and devices; the layout record
every rank reports and its comparison with the plan. Each wrong launch gives one line naming the rank, what the
plan expects and what was found. A device the roles share (dist.colocate) caps each role's memory."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import schedule  # noqa: E402
from plan import (  # noqa: E402
    ANY_DEVICE_ENV,
    PlanError,
    check_launch,
    check_placement,
    device_matches,
    layout_mismatches,
    layout_record,
    make_train_plan,
    plan_nodes,
)
from planner import specs  # noqa: E402

WL = specs.Workload(prompts_per_step=4, samples_per_prompt=8, prompt_len=20, gen_samples=[30], max_batch=32)


@pytest.fixture(scope="module")
def two_node_plan() -> dict:
    """exp/clusters/cpu_2node.yaml planned for the shipped tiny model: 2 machines of 2 CPU ranks."""
    cluster = specs.load_cluster(ROOT / "exp/clusters/cpu_2node.yaml")
    return schedule.plan(cluster, specs.load_model_spec(ROOT / "exp/tiny-model"), WL)


def env(rank: int, node: int, local: int, nproc: int, **extra) -> dict:
    return {"RANK": str(rank), "GROUP_RANK": str(node), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(nproc)} | {
        k: str(v) for k, v in extra.items()
    }


def good_layout(plan: dict, device: str = "cpu") -> list[dict]:
    out = []
    for node, n in enumerate(plan_nodes(plan)):
        for local in range(n["count"]):
            out.append(layout_record(plan, env(n["first"] + local, node, local, n["count"]), device))
    return out


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------- the mapping


def test_plan_nodes_of_the_two_node_cluster(two_node_plan):
    assert plan_nodes(two_node_plan) == [
        {"machine": 0, "gpu_type": "cpu", "first": 0, "count": 2},
        {"machine": 1, "gpu_type": "cpu", "first": 2, "count": 2},
    ]
    for node, n in enumerate(plan_nodes(two_node_plan)):
        for local in range(2):
            check_placement(two_node_plan, n["first"] + local, node, local, 2, "cpu")


def test_node_order_is_rank_order_not_the_machine_index():
    """schedule.py puts the machines holding pipeline stage 0 first: node 0 may be cluster machine 1."""
    plan = make_train_plan(1, 1, 1, [(0, 4)], world_size=3)
    for e, m in zip(plan["ranks"], [1, 0, 0]):
        e.update(machine=m, gpu_type="cpu")
    assert [(n["machine"], n["first"], n["count"]) for n in plan_nodes(plan)] == [(1, 0, 1), (0, 1, 2)]
    check_placement(plan, 0, 0, 0, 1, "cpu")
    check_placement(plan, 2, 1, 1, 2, "cpu")


def test_heterogeneous_ranks_per_node():
    plan = make_train_plan(3, 1, 1, [(0, 4)], world_size=4)
    for e, m in zip(plan["ranks"], [0, 0, 0, 1]):
        e.update(machine=m, gpu_type="cpu")
    check_placement(plan, 2, 0, 2, 3, "cpu")
    check_placement(plan, 3, 1, 0, 1, "cpu")
    with pytest.raises(PlanError) as e:  # torchrun with 2+2 ranks puts rank 2 on node 1
        check_placement(plan, 2, 1, 0, 2, "cpu")
    assert "the plan puts 1 rank(s) (ranks 3..3) on node 1 (machine 1), found 2 on that node" in one_line(e)


def test_a_machine_whose_ranks_are_not_contiguous_is_refused():
    plan = make_train_plan(2, 1, 1, [(0, 4)], world_size=3)
    for e, m in zip(plan["ranks"], [0, 1, 0]):
        e["machine"] = m
    with pytest.raises(PlanError) as e:
        plan_nodes(plan)
    assert "plan machine 0 holds ranks [0, 2], not one contiguous block" in one_line(e)


def test_plans_without_machines_check_no_placement():
    plan = make_train_plan(1, 1, 1, [(0, 4)], world_size=2)  # default_plan's kind: no machine, no gpu_type
    assert plan_nodes(plan) is None
    check_placement(plan, 1, 5, 0, 7, "NVIDIA H800")


# ----------------------------------------------------------------------------- each wrong launch, one line


def test_bad_node(two_node_plan):
    with pytest.raises(PlanError) as e:
        check_placement(two_node_plan, 3, 2, 1, 2, "cpu")
    assert one_line(e) == (
        "placement: rank 3 (node 2, local rank 1): the plan has 2 machine(s) (nodes 0..1), found node 2"
    )


def test_bad_local_rank(two_node_plan):
    with pytest.raises(PlanError) as e:
        check_placement(two_node_plan, 2, 1, 1, 2, "cpu")
    msg = one_line(e)
    assert msg.startswith("placement: rank 2 (node 1, local rank 1): ")
    assert "node 1 (machine 1) ranks 2..3, so local rank 1 is rank 3, found rank 2" in msg


def test_wrong_rank_count_on_a_node(two_node_plan):
    with pytest.raises(PlanError) as e:
        check_placement(two_node_plan, 2, 1, 0, 3, "cpu")
    assert one_line(e) == (
        "placement: rank 2 (node 1, local rank 0): the plan puts 2 rank(s) (ranks 2..3) on node 1 (machine 1), "
        "found 3 on that node (LOCAL_WORLD_SIZE)"
    )


def test_wrong_device_type(two_node_plan):
    plan = copy.deepcopy(two_node_plan)
    for r in plan["ranks"][2:]:
        r["gpu_type"] = "H800"
    with pytest.raises(PlanError) as e:  # a GPU cluster's plan launched on CPU
        check_placement(plan, 2, 1, 0, 2, "cpu")
    msg = one_line(e)
    assert msg.startswith("placement: rank 2 (node 1, local rank 0): the plan expects a H800 device, found 'cpu'")
    assert ANY_DEVICE_ENV in msg
    check_placement(plan, 2, 1, 0, 2, "cpu", any_device=True)  # the explicit override
    check_placement(plan, 2, 1, 0, 2, "NVIDIA H800")
    with pytest.raises(PlanError, match="the plan expects a cpu device, found 'NVIDIA H20'"):
        check_placement(two_node_plan, 0, 0, 0, 2, "NVIDIA H20")  # a CPU plan on a GPU node


@pytest.mark.parametrize(
    "gpu_type, name, ok",
    [
        ("H800", "NVIDIA H800", True),
        ("h800", "NVIDIA H800 PCIe", True),
        ("A100", "NVIDIA A100-SXM4-80GB", True),
        ("H20", "NVIDIA H20", True),
        ("H20", "NVIDIA H200", False),
        ("H100", "NVIDIA H100 80GB HBM3", True),
        ("H800", "NVIDIA H20", False),
        ("cpu", "cpu", True),
        ("cpu", "NVIDIA H800", False),
        ("H800", "cpu", False),
    ],
)
def test_device_matches(gpu_type, name, ok):
    assert device_matches(gpu_type, name) is ok


# ----------------------------------------------------------------------------- layout records


def test_layout_record_fields(two_node_plan):
    rec = layout_record(two_node_plan, env(0, 0, 0, 2), "cpu")
    assert list(rec) == ["rank", "role", "replica", "tp_rank", "stage", "dp", "tp", "node", "local_rank", "device"]
    assert rec == {
        "rank": 0,
        "role": "train",
        "replica": None,
        "tp_rank": None,
        "stage": 0,
        "dp": 0,
        "tp": 0,
        "node": 0,
        "local_rank": 0,
        "device": "cpu",
    }
    roll = layout_record(two_node_plan, env(3, 1, 1, 2), "cpu")
    rep = two_node_plan["ranks"][3]["replica"]
    assert (roll["role"], roll["replica"], roll["tp_rank"], roll["stage"]) == ("rollout", rep, 0, None)


def test_layout_record_of_tp_replicas_and_idle_ranks():
    cluster, model = (
        specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 5),
        specs.load_model_spec(ROOT / "exp/tiny-model"),
    )
    plan = schedule.plan(cluster, model, WL, train_layout=(2, 1, 1), rollout_tp=2)
    recs = [layout_record(plan, env(r, 0, r, 5), "cpu") for r in range(5)]
    assert [(x["role"], x["replica"], x["tp_rank"]) for x in recs] == [
        ("train", None, None),
        ("train", None, None),
        ("rollout", 0, 0),
        ("rollout", 0, 1),
        ("idle", None, None),  # the fifth CPU holds no whole TP-2 group
    ]
    assert layout_mismatches(plan, recs) == []


def test_layout_mismatches(two_node_plan):
    assert layout_mismatches(two_node_plan, good_layout(two_node_plan)) == []
    gpu = good_layout(two_node_plan, device="NVIDIA H800")
    problems = layout_mismatches(two_node_plan, gpu)
    assert len(problems) == 4 and all("expects a cpu device, found 'NVIDIA H800'" in p for p in problems)
    assert layout_mismatches(two_node_plan, gpu, any_device=True) == []
    # node 1 runs 3 ranks, node 0 one: torchrun's ranks 1..3 sit on node 1
    skewed = [layout_record(two_node_plan, env(0, 0, 0, 1), "cpu")] + [
        layout_record(two_node_plan, env(r, 1, r - 1, 3), "cpu") for r in (1, 2, 3)
    ]
    problems = layout_mismatches(two_node_plan, skewed)
    assert problems[0] == (
        "placement: rank 0 (node 0, local rank 0): the plan puts 2 rank(s) (ranks 0..1) on node 0 (machine 0), "
        "found 1 on that node (LOCAL_WORLD_SIZE)"
    )
    other = good_layout(two_node_plan)
    other[3] = {**other[3], "role": "train", "replica": None, "tp_rank": None, "stage": 0, "dp": 1, "tp": 0}
    (problem,) = layout_mismatches(two_node_plan, other)
    assert problem.startswith("placement: rank 3: the plan makes it {'role': 'rollout'") and "another plan" in problem
    assert all("\n" not in p for p in problems + [problem])


def test_check_launch_gathers_and_raises_on_every_rank(world_of_one):
    plan = make_train_plan(1, 1, 1, [(0, 4)])
    plan["ranks"][0].update(machine=0, gpu_type="cpu")
    import torch

    cpu = torch.device("cpu")
    assert check_launch(plan, cpu, env(0, 0, 0, 1)) == [layout_record(plan, env(0, 0, 0, 1), "cpu")]
    plan["ranks"][0]["gpu_type"] = "H800"
    with pytest.raises(PlanError) as e:
        check_launch(plan, cpu, env(0, 0, 0, 1))
    assert one_line(e).startswith("placement: rank 0 (node 0, local rank 0): the plan expects a H800 device")
    assert check_launch(plan, cpu, env(0, 0, 0, 1, **{ANY_DEVICE_ENV: 1}))[0]["device"] == "cpu"


def test_colocated_gpu_caps_each_role_and_refuses_layouts_gloo_cannot_run(monkeypatch):
    """share_device on a (pretend) GPU: a default plan (no rollout section: one single-rank replica per rollout
    rank) caps each role at its memory fraction; a train layout of more than one rank, or a TP rollout replica, is
    one SetupError naming the layout (gloo cannot gather CUDA tensors)."""
    from types import SimpleNamespace

    import torch

    from config import load_config
    from errors import SetupError
    from plan import RolloutReplica
    from train import share_device

    caps = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: caps.append((f, device)))
    cfg = load_config(["config=gpu_single"])
    gpu = torch.device("cuda", 0)
    one = [RolloutReplica(0, [0], 1.0)]
    for role, fraction in (("train", cfg.dist.train_memory_fraction), ("rollout", cfg.dist.rollout_memory_fraction)):
        share_device(cfg, SimpleNamespace(role=role, dp=1, tp=1, pp=1, replicas=one), gpu)
        assert caps[-1] == (fraction, gpu) and fraction > 0
    bad = [
        (dict(dp=2, tp=1, pp=1, replicas=one), "dp=2"),
        (dict(dp=1, tp=1, pp=2, replicas=one), "pp=2"),
        (dict(dp=1, tp=1, pp=1, replicas=[RolloutReplica(0, [0, 1], 1.0)]), "rollout replicas of TP 1"),
    ]
    for layout, named in bad:
        with pytest.raises(SetupError, match=named):
            share_device(cfg, SimpleNamespace(role="train", **layout), gpu)
    before = len(caps)  # on CPU every layout runs colocated and nothing is capped
    share_device(cfg, SimpleNamespace(role="train", dp=2, tp=1, pp=1, replicas=one), torch.device("cpu"))
    assert len(caps) == before
