"""Fault tolerance, end to end on CPU (tiny model; 2 train ranks and rollout replicas as planned).

* SIGKILL a train rank, then (after the first resume) TP follower 3 of a TP-2 replica, at random steps, on a plan with
  an idle rank; relaunch with resume=auto until the steps are done (one run, three tests): the ledger must show every
  planned trajectory consumed exactly once, monotonic versions, the staleness bound for every token before and after
  the restart, metrics.jsonl each step exactly once, in order; layout.json what the plan says, the idle rank named
  and waiting to the end.
* SIGSTOP a TP-1 rollout rank and a TP follower (6 ranks: 2 train, a TP-2 and two TP-1 replicas): the head drops the
  plain rank within dist.rollout_timeout_s and the whole TP-2 replica (its leader stalls in the replica's
  collective), re-queues their groups, finishes with the other replica, and exits non-zero naming every stuck rank
  (so the launcher reclaims them).
* A rollout relay and a machine-mate lost mid weight sync (stopped or killed; two runs, each losing one of each).
Set HEXRL_FAULT_SEED to replay a failure (the seed is in every assertion message). The head's side of these faults,
in process: tests/unit/test_head_faults.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny import ENV, ROOT

from plan import layout_mismatches, make_train_plan

STEPS, B, G = 6, 2, 4


def base_args(model_dir: Path, run_dir: Path, eta: int, extra=()) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"logging.run_dir={run_dir}",
        "logging.run_name=r",
        f"train.total_steps={STEPS}",
        "train.max_train_seconds=0",
        f"train.prompts_per_step={B}",
        f"rollout.samples_per_prompt={G}",
        "rollout.max_new_tokens=16",
        "data.num_test=4",
        "data.num_train=200",
        "logging.eval_every=3",
        "logging.progress=false",
        f"max_staleness={eta}",
        "checkpoint.every=2",
        "checkpoint.keep=2",
        "resume=auto",
        "dist.timeout_s=90",
        "train.shard_state=true",  # the 2 train ranks shard their state with FSDP (the CPU demo config does not)
        *extra,
    ]


def launch(args: list[str], log_prefix: Path, nproc: int = 4) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        "train.py",
        *args,
    ]
    out, err = open(f"{log_prefix}.out", "w"), open(f"{log_prefix}.err", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=err, start_new_session=True)


def worker_pids(agent_pid: int) -> dict[int, int]:
    """Global rank -> pid of the workers torchrun started (children of the agent, RANK in their environment)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            pids[int(env["RANK"])] = int(entry.name)
    return pids


def step_lines(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [m for m in lines if "loss" in m]


def wait_until(cond, proc: subprocess.Popen, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def check_run(run: Path, eta: int, note: str) -> None:
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    keys = [(e["group_id"], e["sample_idx"]) for e in ledger]
    assert len(keys) == len(set(keys)), f"{note}: a trajectory was trained twice"
    assert len(keys) == STEPS * B * G, f"{note}: {len(keys)} ledger lines, planned {STEPS * B * G}"
    assert [e["step"] for e in ledger] == [s for s in range(1, STEPS + 1) for _ in range(B * G)], (
        f"{note}: versions not monotonic / a step missing or repeated"
    )
    for e in ledger:
        assert e["trainer_version"] == e["step"] - 1, (note, e)
        assert e["trainer_version"] - e["min_version"] <= eta, (note, "staleness bound broken", e)
        assert e["min_version"] <= e["max_version"] <= e["trainer_version"], (note, e)
        assert e["updated"], (note, e)
    groups = {}
    for e in ledger:  # a group is trained whole, at one step
        groups.setdefault(e["group_id"], set()).add((e["prompt_id"], e["step"]))
    assert all(len(v) == 1 for v in groups.values()), f"{note}: a group split across steps or prompts"
    assert [m["step"] for m in step_lines(run)] == list(range(1, STEPS + 1)), f"{note}: metrics steps"


def kill_at(args: list[str], run: Path, prefix: Path, step: int, rank: int, note: str, nproc: int = 4) -> int:
    """Launch (resume=auto), SIGKILL `rank` once `step` steps are logged; returns the steps logged at death."""
    proc = launch(args, prefix, nproc)
    # the previous launch's lines count only once this one has cut the logs back (it prints the run directory
    # after that); before, an old metrics.jsonl can already hold `step` lines while no worker exists yet
    out = Path(f"{prefix}.out")
    wait_until(lambda: "hexrl run directory:" in out.read_text(), proc, 180, f"launch {prefix.name} ({note})")
    wait_until(lambda: len(step_lines(run)) >= step, proc, 180, f"step {step} ({note})")
    pid = wait_until(lambda: worker_pids(proc.pid).get(rank), proc, 30, f"rank {rank}'s process ({note})")
    os.kill(pid, signal.SIGKILL)
    assert finish(proc) != 0, note
    return len(step_lines(run))


def resume_choices(done: int) -> tuple[int | None, int | None]:
    """Where a launch killed after `done` steps may resume (checkpoint.every=2): the newest complete checkpoint, or
    the one before it when killed while writing it -- before the first there is none, and the run starts afresh."""
    newest = done - done % 2
    return newest or None, newest - 2 if newest > 2 else None


def resumed_step(prefix: Path) -> int | None:
    lines = [x for x in Path(f"{prefix}.out").read_text().splitlines() if x.startswith("hexrl: resuming from")]
    return int(lines[0].split("step_")[1].split()[0]) if lines else None


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
def crash_run(tmp_path_factory, tiny_model_dir):
    """One run audited by the three tests below. 5 ranks: 2 train, a TP-2 replica [2, 3], idle rank 4; small weight
    buckets (every version reaches the TP ranks in many pieces, applied one at a time). Two crashes: a train rank,
    then (after the first resume) TP follower 3, at random steps; then a relaunch with resume=auto to the end."""
    seed = int(os.environ.get("HEXRL_FAULT_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    eta = rng.choice([0, 1, 2])
    k1, train_victim = rng.randint(1, 3), rng.choice([0, 1])
    k2 = rng.randint(k1 + 1, STEPS - 1)
    note = f"HEXRL_FAULT_SEED={seed}: eta {eta}, kill rank {train_victim} at step {k1}, TP follower 3 at {k2}"
    tmp_path = tmp_path_factory.mktemp("crash")
    plan = replica_plan(tmp_path / "plan.json", layers_of(tiny_model_dir), [([2, 3], 1.0)], idle=1)
    run = tmp_path / "r"
    args = base_args(tiny_model_dir, tmp_path, eta, [f"plan={plan}", "dist.weight_bucket_mb=0.02"])

    done = kill_at(args, run, tmp_path / "launch0", k1, train_victim, note, nproc=5)
    done = max(done, kill_at(args, run, tmp_path / "launch1", k2, 3, note, nproc=5))
    proc = launch(args, tmp_path / "launch2", nproc=5)
    assert finish(proc) == 0, f"{note}\n" + (tmp_path / "launch2.err").read_text()[-3000:]
    return tmp_path, plan, run, eta, done, note


def test_sigkill_train_then_rollout_rank_resume_exactly_once(crash_run):
    """Two crashes in one run: a train rank, then (after the first resume) a rollout rank, at random steps."""
    tmp_path, _, run, eta, done, note = crash_run
    for prefix, before in (("launch1", None), ("launch2", done)):
        step = resumed_step(tmp_path / prefix)
        if before is not None:
            assert step in resume_choices(before), (note, prefix, before, step)
        assert step is None or step % 2 == 0, (note, prefix, step)
    check_run(run, eta, note)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_4", "step_6"], (note, ckpts)  # keep=2, no temp dir left behind

    # the checkpoint's model directory is a plain HF model, bitwise the trainer's (fp32 master) weights
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_6" / "model")
    shards = [
        torch.load(run / "checkpoints" / "step_6" / f"train_rank{r}.pt", weights_only=True)["trainer"] for r in (0, 1)
    ]
    assert [s["step"] for s in shards] == [STEPS, STEPS]
    sd = model.state_dict()
    # sharded like the state (FSDP over the 2 DP ranks): each rank wrote its rows of every tensor, together the model
    assert set(shards[0]["model"]) == set(shards[1]["model"]), note
    for name in shards[0]["model"]:
        assert torch.equal(sd[name], torch.cat([s["model"][name] for s in shards])), (note, name)

    def numel(s):
        return sum(t.numel() for t in s["model"].values())

    def moments(s):
        return sum(t.numel() for st in s["optimizer"]["state"].values() for k, t in st.items() if k != "step")

    total = sum(sd[n].numel() for n in shards[0]["model"])
    for s in shards:  # size per rank follows its shard: about half of the weights, and AdamW's two moments of them
        assert abs(numel(s) - total / 2) <= 0.05 * total, (note, numel(s), total)
        assert moments(s) == 2 * numel(s), note


def test_tp2_replica_trains_exactly_once_and_an_idle_rank_waits(crash_run):
    tmp_path, plan, run, eta, _, note = crash_run
    assert "[rank 4] idle: the plan gives this rank no role" in (tmp_path / "launch2.err").read_text()
    assert (
        "hexrl: rollout replicas 0: ranks [2, 3] share 1.000; idle ranks [4]" in (tmp_path / "launch2.out").read_text()
    )
    check_run(run, eta, f"TP-2 replica; {note}")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines if "loss" in m]
    measured = [m for m in trained if "replica0_token_share" in m]  # none before a launch's replicas report tokens
    assert measured and measured[-1] is trained[-1]
    assert all(m["replica0_token_share"] == m["replica0_planned_share"] == 1.0 for m in measured)
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


def test_sigkill_tp_follower_then_resume_exactly_once(crash_run):
    tmp_path, _, run, eta, done, note = crash_run
    step = resumed_step(tmp_path / "launch2")
    assert step in resume_choices(done), (note, done, step)
    check_run(run, eta, note)


@pytest.mark.alone  # times the drop against dist.rollout_timeout_s
def test_stuck_rollout_rank_is_dropped_and_named(tmp_path, tiny_model_dir):
    """6 ranks: 2 train, a TP-2 replica [2, 3], TP-1 replicas [4] and [5]. After step 1, SIGSTOP rollout rank 5 and
    TP follower 3: rank 5 is dropped within the timeout; 3's leader stalls in the replica's collective and the head
    drops the replica [2, 3]; replica [4] finishes the run."""
    plan = replica_plan(tmp_path / "plan.json", layers_of(tiny_model_dir), [([2, 3], 0.5), ([4], 0.25), ([5], 0.25)])
    run, timeout = tmp_path / "r", 4
    # the process-group timeout outlasts the run, so the stalled leader is dropped by the head, not by gloo
    args = base_args(tiny_model_dir, tmp_path, 1, [f"plan={plan}", f"dist.rollout_timeout_s={timeout}"])
    proc = launch([*args, "dist.timeout_s=400"], tmp_path / "stop", nproc=6)
    wait_until(lambda: len(step_lines(run)) >= 1, proc, 180, "step 1")
    pids = worker_pids(proc.pid)
    os.kill(pids[5], signal.SIGSTOP)
    os.kill(pids[3], signal.SIGSTOP)
    t_stop = time.monotonic()
    err = tmp_path / "stop.err"
    try:
        wait_until(lambda: "warning: rollout rank 5" in err.read_text(), proc, timeout + 60, "rank 5 dropped")
        t_dropped = time.monotonic() - t_stop
        wait_until(lambda: "warning: rollout rank 2" in err.read_text(), proc, timeout + 90, "replica [2, 3] dropped")
        # the head finishes without them, then exits non-zero so the launcher reclaims the stuck processes
        wait_until(lambda: not Path(f"/proc/{pids[0]}").exists(), proc, 240, "the head to finish")
    finally:
        for r in (3, 5):
            os.kill(pids[r], signal.SIGKILL)
    rc = finish(proc)
    stderr = err.read_text()
    assert rc != 0
    assert t_dropped < timeout + 30, t_dropped
    assert f"[rank 0] error: finished at step {STEPS} without rollout rank(s) [2, 3, 5]" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr.split("[rank 0] error:")[0], stderr[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    # both stopped at once: the order of the two drops is not defined
    assert sorted((e["event"], e["rank"]) for e in events) == [("rollout_rank_lost", 2), ("rollout_rank_lost", 5)]
    check_run(run, 1, "SIGSTOP rank 5 and TP follower 3")


def launch_without_agent(args: list[str], log_prefix: Path, rank_env: dict[int, dict], nproc: int = 4) -> list:
    """The ranks of train.py as plain processes (the env torchrun would set, plus `rank_env[rank]`): a SIGKILLed
    rank then ends only itself -- torchrun's agent would end every rank of the job, which resume covers (above)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = {
            **ENV,
            **rank_env.get(rank, {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        out, err = open(f"{log_prefix}.{rank}.out", "w"), open(f"{log_prefix}.{rank}.err", "w")
        procs.append(subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=out, stderr=err))
    return procs


@pytest.mark.alone  # times the drops against dist.rollout_timeout_s
@pytest.mark.parametrize(
    "victims",  # rank -> (version, signal), in the order they are lost
    [{4: (2, "KILL"), 2: (4, "STOP")}, {2: (2, "KILL"), 4: (4, "STOP")}, {4: (2, "STOP"), 2: (4, "KILL")}],
    ids=["killed-mate-then-stopped-relay", "killed-relay-then-stopped-mate", "stopped-mate-then-killed-relay"],
)
def test_rollout_rank_lost_mid_weight_sync_is_dropped_and_the_run_finishes(tmp_path, tiny_model_dir, victims):
    """Ranks 2, 3 and 4 are the rollout replicas of one machine: its lowest live one (2, then 3 once 2 is lost) is the
    relay, which receives each bucket from the train ranks and forwards it to its machine-mates. Each victim signals
    itself half-way through receiving a version (about 12 buckets of 0.05 MB): at version 2 mate 4 (relay 2 forwards
    to 3 and 4) or relay 2 (both its mates left waiting on it), at version 4 relay 2 (its mate 3 left waiting on it)
    or mate 4 (of relay 3). Each is dropped within dist.rollout_timeout_s and named; replica 3 finishes the run with
    whole versions: every trajectory trained exactly once, the staleness bound kept for every token."""
    from parallel.weight_sync import FAULT_ENV

    run, timeout = tmp_path / "r", 4
    args = base_args(tiny_model_dir, tmp_path, 1, [f"dist.rollout_timeout_s={timeout}", "dist.weight_bucket_mb=0.05"])
    args = [a for a in args if a not in ("checkpoint.every=2", "resume=auto")] + ["checkpoint.every=0"]
    args += ["plan.num_rollout=3"]
    rank_env = {rank: {FAULT_ENV: f"{rank}:{version}:{sig}"} for rank, (version, sig) in victims.items()}
    procs = launch_without_agent(args, tmp_path / "l", rank_env, nproc=5)
    note = ", ".join(f"{sig} rank {rank} at version {version}" for rank, (version, sig) in victims.items())
    try:
        head_rc = procs[0].wait(timeout=240)
        err = (tmp_path / "l.0.err").read_text()
        assert head_rc == 3, err[-3000:]  # finished, naming the lost ranks, so a launcher reclaims them
        assert f"[rank 0] error: finished at step {STEPS} without rollout rank(s) [2, 4]" in err, err[-3000:]
        for victim in victims:
            assert f"warning: rollout rank {victim}" in err, err[-3000:]
        assert procs[3].wait(timeout=60) == 0, (tmp_path / "l.3.err").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    assert [(e["event"], e["rank"]) for e in events] == [("rollout_rank_lost", v) for v in victims], events
    for version, _ in victims.values():
        lost = [m for m in step_lines(run) if m["step"] == version]
        assert lost and lost[0]["weight_sync_s"] < timeout + 10, lost  # dropped within the timeout (+ its re-send)
    check_run(run, 1, f"{note} mid-sync")
