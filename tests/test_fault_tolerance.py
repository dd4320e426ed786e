"""Fault tolerance, end to end on CPU (4 ranks: 2 train, 2 rollout, tiny model).

* SIGKILL a train rank / a rollout rank at a random step, relaunch with resume=auto until the steps are done;
  the ledger must show every planned trajectory consumed exactly once, monotonic versions, the staleness bound for
  every token before and after the restart, and metrics.jsonl must hold each step exactly once, in order.
* SIGSTOP a rollout rank: the head drops it within dist.rollout_timeout_s, re-queues its groups, finishes with the
  other rollout rank, and exits non-zero naming the stuck rank (so the launcher reclaims it).
Set HEXRL_FAULT_SEED to replay a failure (the seed is in every assertion message).
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


def resumed_step(prefix: Path) -> int | None:
    lines = [x for x in Path(f"{prefix}.out").read_text().splitlines() if x.startswith("hexrl: resuming from")]
    return int(lines[0].split("step_")[1].split()[0]) if lines else None


def test_sigkill_train_then_rollout_rank_resume_exactly_once(tmp_path, tiny_model_dir):
    """Two crashes in one run: a train rank, then (after the first resume) a rollout rank, at random steps."""
    seed = int(os.environ.get("HEXRL_FAULT_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    eta = rng.choice([0, 1, 2])
    k1, train_victim = rng.randint(1, 3), rng.choice([0, 1])
    k2, rollout_victim = rng.randint(k1 + 1, STEPS - 1), rng.choice([2, 3])
    note = f"HEXRL_FAULT_SEED={seed}: eta {eta}, kill rank {train_victim} at step {k1}, rank {rollout_victim} at {k2}"
    run = tmp_path / "r"
    args = base_args(tiny_model_dir, tmp_path, eta)

    done = kill_at(args, run, tmp_path / "launch0", k1, train_victim, note)
    done = max(done, kill_at(args, run, tmp_path / "launch1", k2, rollout_victim, note))
    proc = launch(args, tmp_path / "launch2")
    assert finish(proc) == 0, f"{note}\n" + (tmp_path / "launch2.err").read_text()[-3000:]

    for prefix, before in (("launch1", None), ("launch2", done)):
        step = resumed_step(tmp_path / prefix)
        if before is not None:  # the newest complete checkpoint (or the one before it,
            newest = before - before % 2  # when killed while writing it)
            assert step in (newest, newest - 2), (note, prefix, before, step)
        assert step is None or step % 2 == 0, (note, prefix, step)
    check_run(run, eta, note)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_4", "step_6"], (note, ckpts)  # keep=2, no temp dir left behind

    # the checkpoint's model directory is a plain HF model, bitwise the trainer's (fp32 master) weights
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_6" / "model")
    shard = torch.load(run / "checkpoints" / "step_6" / "train_rank0.pt", weights_only=True)["trainer"]
    assert shard["step"] == STEPS
    sd = model.state_dict()
    for name, value in shard["model"].items():  # DP: rank 0 holds every parameter
        assert torch.equal(sd[name], value), (note, name)


def test_stuck_rollout_rank_is_dropped_and_named(tmp_path, tiny_model_dir):
    run = tmp_path / "r"
    timeout = 4
    proc = launch(base_args(tiny_model_dir, tmp_path, 1, [f"dist.rollout_timeout_s={timeout}"]), tmp_path / "stop")
    wait_until(lambda: len(step_lines(run)) >= 1, proc, 180, "step 1")
    pids = worker_pids(proc.pid)
    os.kill(pids[3], signal.SIGSTOP)
    t_stop = time.monotonic()
    err = tmp_path / "stop.err"
    try:
        wait_until(lambda: "warning: rollout rank 3" in err.read_text(), proc, timeout + 60, "rank 3 dropped")
        t_dropped = time.monotonic() - t_stop
        # the head finishes without it, then exits non-zero so the launcher reclaims the stuck process
        wait_until(lambda: not Path(f"/proc/{pids[0]}").exists(), proc, 180, "the head to finish")
    finally:
        os.kill(pids[3], signal.SIGKILL)
    rc = finish(proc)
    stderr = err.read_text()
    assert rc != 0
    assert t_dropped < timeout + 30, t_dropped
    assert "[rank 0] error: finished at step 6 without rollout rank(s) [3]" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr.split("[rank 0] error:")[0], stderr[-3000:]
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
    assert [(e["event"], e["rank"]) for e in events] == [("rollout_rank_lost", 3)], events
    check_run(run, 1, "SIGSTOP rank 3")


class RecordingChannel:
    """The head's control channel, in process: records what is sent, nobody answers."""

    def __init__(self, peers):
        self.peers, self.closed, self.sent = peers, set(), []

    def send(self, dst, kind, **payload):
        self.sent.append((dst, kind, payload))

    def poll(self, timeout_s=0.0, peers=None):
        time.sleep(min(timeout_s, 0.01))
        return []

    def silent_peers(self, seconds):
        return []


class DeliveredInbox:
    """TrajectoryInbox's interface, in process: the groups a rollout rank has delivered, by (rank, group id)."""

    def __init__(self):
        self.groups = {}

    def take(self, src, group_id):
        return self.groups.pop((src, group_id))


class RecordingSender:
    """WeightSender's interface: version 0 is in flight to every rollout rank until `send` is called again."""

    def __init__(self, channel, ranks):
        self.channel, self.in_flight_version, self.receivers = channel, 0, set(ranks)

    def receivers_in_flight(self):
        return set(self.receivers)

    def send(self, channel, dst_ranks, state_dict, version, device, wait_timeout_s=None):
        for dst in dst_ranks:
            self.channel.send(dst, "weights", version=version)
        self.in_flight_version, self.receivers = version, set(dst_ranks)

    def forget(self, rank):
        self.receivers.discard(rank)


def make_head(tmp_path, channel, *overrides):
    import types

    import torch

    from checkpoint import CheckpointWriter
    from config import load_config
    from parallel.rankmap import RolloutReplica
    from runlog import RunLog
    from train import TrainHead

    cfg = load_config(
        [
            "train.prompts_per_step=2",
            "rollout.samples_per_prompt=1",
            "logging.progress=false",
            "logging.wandb=disabled",
            *overrides,
        ]
    )
    replicas = [RolloutReplica(i, [r], 1 / len(channel.peers)) for i, r in enumerate(channel.peers)]
    groups = types.SimpleNamespace(
        rollout_ranks=list(channel.peers), replicas=replicas, idle_ranks=[], train_ranks=[0], train_group=None
    )
    head = TrainHead(
        cfg,
        groups,
        None,
        [{"prompt_id": i} for i in range(20)],
        [],
        RunLog(cfg, tmp_path, {}),
        torch.device("cpu"),
        channel,
        CheckpointWriter(tmp_path, 2, None, None),
    )
    head.commands = []
    head.command = head.commands.append  # no train followers in process (no process group)
    return head


def test_a_rank_dropped_while_weights_are_awaited_gets_no_work_on_old_weights(world_of_one, tmp_path):
    """Deterministically: the head has taken batch 1 (version 0 -> 1) and waits for
    every rank to acknowledge version 0's weights before sending version 1's. Rank 2 never does, so it is dropped
    during that wait and its groups are re-queued -- but no group may be granted before version 1's weights are
    out, or rank 1 would generate version-1 groups with version-0 weights (staleness v - 2 > eta = 1)."""
    from buffer import Trajectory

    channel = RecordingChannel([1, 2])
    head = make_head(tmp_path, channel, "staleness.max_staleness=1", "dist.rollout_timeout_s=0.3")
    head.sender, head.state_dict = RecordingSender(channel, [1, 2]), {}
    head.buffer.weights_sent(0)
    head.grant()  # (0 + eta + 1) * B = 4 groups, 2 per rank
    assert sorted(t.rank for t in head.buffer.in_flight.values()) == [1, 1, 2, 2]
    head.inbox = DeliveredInbox()
    for ticket in [t for t in head.buffer.in_flight.values() if t.rank == 1]:
        traj = Trajectory(ticket.prompt_id, 0, [1], [2], [0.0], [0], 1.0, group_id=ticket.group_id)
        head.inbox.groups[(1, ticket.group_id)] = [traj]
        head.handle(1, {"kind": "delivered", "group_id": ticket.group_id, "counters": {}})
    head.acks.taken(1, 0)  # rank 1 acknowledged version 0; rank 2 is stuck
    head.buffer.take()  # version 1
    sent_before = len(channel.sent)

    head.sync_weights(changed=False)
    head.grant()  # what run() does next

    after = channel.sent[sent_before:]
    kinds = [(dst, kind) for dst, kind, _ in after]
    assert (2, "abort") in kinds and head.rollout_ranks == [1]
    first_weights = kinds.index((1, "weights"))
    assert after[first_weights][2]["version"] == 1
    grants = [i for i, (dst, kind) in enumerate(kinds) if kind == "grant"]
    assert grants and all(i > first_weights for i in grants), kinds
    # rank 2's two groups went back to rank 1, re-admitted at version 1 (with version 1's weights on their way),
    # and capacity (1 + eta + 1) * B - 2 admitted = 4 filled up with two new groups
    in_flight = head.buffer.in_flight.values()
    assert sorted(t.group_id for t in in_flight) == [1, 3, 4, 5] and {(t.rank, t.admit_version) for t in in_flight} == {
        (1, 1)
    }


class ScriptedChannel(RecordingChannel):
    """Delivers scripted messages (seconds after creation, source rank, message); records what is sent."""

    def __init__(self, peers, script):
        super().__init__(peers)
        self.t0, self.script = time.monotonic(), sorted(script, key=lambda x: x[0])

    def poll(self, timeout_s=0.0, peers=None):
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic() - self.t0
            due = [(src, msg) for at, src, msg in self.script if at <= now]
            self.script = [x for x in self.script if x[0] > now]
            if due or time.monotonic() >= deadline:
                return due
            time.sleep(0.01)

    def silent_peers(self, seconds):  # nobody has spoken since creation: everyone is "silent"
        return list(self.peers) if time.monotonic() - self.t0 > seconds else []


def test_slow_start_is_not_a_stuck_rank(tmp_path):
    """Rollout ranks still loading must not be dropped as stuck: a rank is held to dist.rollout_timeout_s
    only after it says `ready`, however long its start takes."""
    ready = {"kind": "ready", "counters": {}}
    channel = ScriptedChannel([1, 2], [(0.1, 1, ready), (1.5, 2, ready)])  # rank 2: 5x rollout_timeout_s
    head = make_head(tmp_path, channel, "dist.rollout_timeout_s=0.3", "dist.timeout_s=30")
    head.await_ready()
    assert head.rollout_ranks == [1, 2] and head.pool.ready == {1, 2}
    assert not [m for m in channel.sent if m[1] == "abort"], channel.sent


def test_rank_that_never_starts_is_named(tmp_path):
    from parallel.channel import PeerTimeout

    channel = ScriptedChannel([1, 2], [(0.1, 1, {"kind": "ready", "counters": {}})])
    head = make_head(tmp_path, channel, "dist.rollout_timeout_s=0.3", "dist.timeout_s=1.5")
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout) as raised:
        head.await_ready()
    assert "[2]" in str(raised.value) and "ready" in str(raised.value), str(raised.value)
    assert 1.5 <= time.monotonic() - t0 < 10
    assert "wait" in head.commands  # the train followers were kept from timing out meanwhile


def test_abort_starts_no_train_collective_after_an_error_inside_one(tmp_path):
    """An error inside a train-group collective reaches every train rank by itself: abort() then tells only the
    rollout ranks; after a clean collective it tells the train ranks too."""
    channel = RecordingChannel([1, 2])
    head = make_head(tmp_path, channel)
    head.command = lambda kind, **payload: head.commands.append((kind, payload))
    with head.collective():
        pass
    head.abort("after a clean collective")
    assert head.commands == [("abort", {"reason": "after a clean collective"})]
    head.commands.clear()
    channel.sent.clear()
    with pytest.raises(RuntimeError, match="peer gone"), head.collective():
        raise RuntimeError("peer gone")
    head.abort("inside a collective")
    assert head.commands == []
    assert [(dst, kind) for dst, kind, _ in channel.sent] == [(1, "abort"), (2, "abort")]
