"""Rollout replicas as planned, end to end on CPU (tiny model, gloo): a TP-2 replica generates for the trainer,
and losing one of its ranks loses the whole replica but no trajectory.

* a TP-2 replica run beside an idle rank, its TP follower SIGKILLed at step 3 and the run relaunched with
  resume=auto (one run, two tests): exit 0, every planned trajectory consumed exactly once within the staleness
  bound (nothing lost, nothing duplicated), layout.json what the plan says, the idle rank named and waiting to the end;
* SIGSTOP a TP follower (5 ranks: 2 train, a TP-2 and a TP-1 replica): its leader stalls in the replica's
  collective, the head drops the replica, finishes with the other one and names both stuck ranks.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_fault_tolerance import (
    STEPS,
    base_args,
    check_run,
    finish,
    kill_at,
    launch,
    resumed_step,
    step_lines,
    wait_until,
    worker_pids,
)

from plan import layout_mismatches, make_train_plan


def replica_plan(path: Path, num_layers: int, replicas: list[tuple[list[int], float]], idle: int = 0) -> Path:
    """Two DP train ranks (0, 1), the given rollout replicas (ranks, share) and `idle` idle ranks, on machine 0."""
    world = 2 + sum(len(ranks) for ranks, _ in replicas) + idle
    plan = make_train_plan(2, 1, 1, [(0, num_layers)], world_size=world)
    for entry in plan["ranks"]:
        entry.update(machine=0, gpu_type="cpu")
    for entry in plan["ranks"][world - idle :]:
        entry["idle"] = True
    plan["rollout"] = {
        "replicas": [
            {"id": i, "gpu_type": "cpu", "tp": len(ranks), "pp": 1, "ranks": ranks, "share": share}
            for i, (ranks, share) in enumerate(replicas)
        ]
    }
    path.write_text(json.dumps(plan))
    return path


def layers_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, tiny_model_dir):
    """One run of the TP-2 replica beside an idle rank, audited by the two tests below: SIGKILL TP follower 3 at
    step 3 (small weight buckets: every version reaches the TP ranks in many pieces, applied one at a time), then
    relaunch with resume=auto to the end."""
    tmp_path = tmp_path_factory.mktemp("tp2")
    plan = replica_plan(tmp_path / "plan.json", layers_of(tiny_model_dir), [([2, 3], 1.0)], idle=1)
    run = tmp_path / "r"
    args = base_args(tiny_model_dir, tmp_path, 1, [f"plan={plan}", "dist.weight_bucket_mb=0.02"])
    done = kill_at(args, run, tmp_path / "launch0", 3, 3, "SIGKILL TP follower 3 at step 3", nproc=5)
    proc = launch(args, tmp_path / "launch1", nproc=5)
    assert finish(proc) == 0, (tmp_path / "launch1.err").read_text()[-3000:]
    return tmp_path, plan, run, done


def test_tp2_replica_trains_exactly_once_and_an_idle_rank_waits(tp2_run):
    tmp_path, plan, run, _ = tp2_run
    assert "[rank 4] idle: the plan gives this rank no role" in (tmp_path / "launch1.err").read_text()
    assert (
        "hexrl: rollout replicas 0: ranks [2, 3] share 1.000; idle ranks [4]" in (tmp_path / "launch1.out").read_text()
    )
    check_run(run, 1, "TP-2 replica")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["replica0_token_share"] == m["replica0_planned_share"] == 1.0 for m in lines if "loss" in m)
    import torch

    shards = [  # the two train ranks' FSDP shards: together the model
        torch.load(run / "checkpoints" / f"step_{STEPS}" / f"train_rank{r}.pt", weights_only=True)["trainer"]["model"]
        for r in (0, 1)
    ]
    model_bytes = sum(t.numel() * 4 for s in shards for t in s.values())  # fp32 on CPU, sent to the one leader
    for m in (m for m in lines if "loss" in m):  # the model once (+ each bucket's checksum), as the planner says
        assert m["weight_sync_bytes"] == m["weight_sync_predicted_bytes"], m
        assert model_bytes < m["weight_sync_bytes"] < 1.01 * model_bytes and m["weight_sync_dtype"] == "float32", m
    layout = json.loads((run / "layout.json").read_text())  # what ran, rank by rank, is what was planned
    assert layout_mismatches(json.loads(plan.read_text()), layout) == []
    roles = [(r["role"], r["replica"], r["tp_rank"]) for r in layout[2:]]
    assert roles == [("rollout", 0, 0), ("rollout", 0, 1), ("idle", None, None)]


def test_stuck_tp_follower_drops_its_replica(tmp_path, tiny_model_dir):
    plan = replica_plan(tmp_path / "plan.json", layers_of(tiny_model_dir), [([2, 3], 0.5), ([4], 0.5)])
    run, timeout = tmp_path / "r", 4
    # the process-group timeout outlasts the run, so the stalled leader is dropped by the head, not by gloo
    args = base_args(tiny_model_dir, tmp_path, 1, [f"plan={plan}", f"dist.rollout_timeout_s={timeout}"])
    proc = launch([*args, "dist.timeout_s=400"], tmp_path / "stop", nproc=5)
    wait_until(lambda: len(step_lines(run)) >= 1, proc, 180, "step 1")
    pids = worker_pids(proc.pid)
    os.kill(pids[3], signal.SIGSTOP)
    err = tmp_path / "stop.err"
    try:
        wait_until(lambda: "warning: rollout rank 2" in err.read_text(), proc, timeout + 90, "replica [2, 3] dropped")
        wait_until(lambda: not Path(f"/proc/{pids[0]}").exists(), proc, 240, "the head to finish")
    finally:
        os.kill(pids[3], signal.SIGKILL)
    rc = finish(proc)
    stderr = err.read_text()
    assert rc != 0
    assert f"[rank 0] error: finished at step {STEPS} without rollout rank(s) [2, 3]" in stderr, stderr[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    assert [(e["event"], e["rank"]) for e in events] == [("rollout_rank_lost", 2)]
    check_run(run, 1, "SIGSTOP TP follower 3")


def test_sigkill_tp_follower_then_resume_exactly_once(tp2_run):
    tmp_path, _, run, done = tp2_run
    note = "SIGKILL TP follower 3 at step 3"
    step = resumed_step(tmp_path / "launch1")
    assert step is not None and step <= done and step % 2 == 0, (note, done, step)
    check_run(run, 1, note)
