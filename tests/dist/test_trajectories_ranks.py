"""Packed trajectories on the real path rollout leader → train head → train follower, under torchrun (this file is
also that run's worker, see `worker`)."""

import json
import os
import random
import subprocess
import sys

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(TESTS), os.path.join(TESTS, "support"), os.path.join(TESTS, "unit")]  # as a worker
from test_trajectories import canon, make_group  # noqa: E402

from buffer import Trajectory, group_advantages  # noqa: E402
from parallel.trajectories import TrajectorySender  # noqa: E402


# ---------------------------------------------------------------------------------------------- under torchrun
def run_worker(tmp_path, nproc, mode):
    from tiny import ENV, ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", __file__]
    return subprocess.run([*cmd, str(tmp_path), mode], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)


def test_rollout_to_head_to_follower_gives_every_train_rank_todays_list(tmp_path):
    """3 ranks: train head 0 (the real TrainHead.on_message / train_on), train follower 1 (the real TrainFollower),
    rollout leader 2 (the real RolloutWorker.send_results / on_fetch). Every train rank must train on exactly the
    list the JSON path gave it: the rollout's trajectories through to_dict -> JSON -> from_dict, with the head's
    advantages."""
    proc = run_worker(tmp_path, 3, "plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRAJECTORIES_SAME 2 ranks 2 steps" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_leader_stopped_between_result_and_delivery_is_dropped_not_waited_for(tmp_path):
    """Rollout leader 2 SIGSTOPs itself right after announcing its groups (its sends posted, its gloo thread frozen
    before the head's receives are even posted): the head must not wait on those receives (a gloo wait that times
    out would close every pair), but drop rank 2 after dist.rollout_timeout_s, re-queue its groups to rank 3 and
    train on, collectives and point-to-point intact."""
    proc = run_worker(tmp_path, 4, "stop")
    assert "TRAJECTORIES_SAME 2 ranks 2 steps" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rollout rank 2 silent" in proc.stderr, proc.stderr[-3000:]


def worker_group(group_id, prompt_id, G):
    """What a rollout rank 'generates' for a granted group: a function of the ids only (so a test can rebuild it)."""
    rng = random.Random(group_id)
    trajs = make_group(rng, group_id, G, rng.randint(5, 40), 25)
    for t in trajs:
        t.prompt_id = prompt_id
        if t.behav_logprobs and group_id % 2:
            t.behav_logprobs[0] = 0.1  # not a float32: this group travels with float64 log-probs
    return trajs


def worker(tmp: str, mode: str) -> None:
    import signal
    import time
    import types
    from pathlib import Path

    import torch.distributed as dist

    from checkpoint import CheckpointWriter
    from config import load_config
    from parallel.channel import Channel
    from plan import RolloutReplica
    from rollout import RolloutWorker
    from runlog import RunLog
    from train import TrainFollower, TrainHead, broadcast_json

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rollout_ranks = list(range(2, world))
    cfg = load_config(
        [
            "train.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "staleness.max_staleness=1",
            "dist.rollout_timeout_s=3",
            "logging.progress=false",
            "logging.wandb=disabled",
        ]
    )
    train_group = dist.new_group([0, 1])
    replicas = [RolloutReplica(i, [r], 1 / len(rollout_ranks)) for i, r in enumerate(rollout_ranks)]
    groups = types.SimpleNamespace(rollout_ranks=rollout_ranks, replicas=replicas, idle_ranks=[], train_ranks=[0, 1])
    groups.train_group = train_group
    got = []

    class Trainer:  # records what it is asked to train on
        def train_step(self, trajs):
            got.append(canon(trajs))
            return {"loss": 0.0, "grad_norm": 0.0, "trained_tokens": float(sum(len(t.response_ids) for t in trajs))}

    if rank >= 2:
        w = RolloutWorker.__new__(RolloutWorker)  # only its messaging: no model
        w.cfg, w.head, w.is_leader, w.channel, w.last_sent = cfg, 0, True, Channel([0]), time.monotonic()
        w.counters = dict
        w.outbox = TrajectorySender(0, cfg.dist.timeout_s)
        stopped = False
        while not stopped:
            for _, msg in w.channel.poll(timeout_s=1.0):
                if msg["kind"] == "grant":  # finished out of order
                    w.send_results([(g, worker_group(g, p, 4)) for g, p in reversed(msg["groups"])])
                    if mode == "stop" and rank == 2:
                        Path(tmp, "stopped.pid").write_text(str(os.getpid()))
                        os.kill(os.getpid(), signal.SIGSTOP)  # the head SIGKILLs it at the end
                elif msg["kind"] == "fetch":
                    w.on_fetch(msg)
                stopped |= msg["kind"] in ("stop", "abort")
    elif rank == 1:
        TrainFollower(groups, Trainer()).run()
        broadcast_json(got, src=1, group=train_group)  # to the head, which compares
    else:
        head = TrainHead(
            cfg, groups, Trainer(), [{"prompt_id": i} for i in range(50)], [], RunLog(cfg, Path(tmp), {}),
            torch.device("cpu"), Channel(rollout_ranks), CheckpointWriter(Path(tmp), 2, None, None),
        )  # fmt: skip
        head.buffer.weights_sent(0)
        expected = []
        for _ in range(2):
            head.send_grants()
            while not head.buffer.ready():
                head.poll_messages(timeout_s=0.5)
            batch = head.buffer.take()
            head.buffer.weights_sent(head.buffer.version)
            want = []
            for ticket, _ in batch:  # today's path: JSON from the rollout, advantages from the rewards
                group = [
                    Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
                    for t in worker_group(ticket.group_id, ticket.prompt_id, 4)
                ]
                for t, a in zip(group, group_advantages([t.reward for t in group], cfg.train.advantage_eps)):
                    t.advantage = a
                want += group
            expected.append(canon(want))
            head.train_on(batch)
        head.command("stop")
        for r in head.pool.live:
            head.channel.send(r, "stop")
        follower = broadcast_json(None, src=1, group=train_group)
        assert got == expected, "the head trained on another list than the JSON path gives"
        assert json.loads(json.dumps(expected)) == follower, "the follower trained on another list"
        assert head.pool.lost == ([2] if mode == "stop" else [])
        print(f"TRAJECTORIES_SAME 2 ranks {len(expected)} steps", flush=True)
        if mode == "stop":
            os.kill(int(Path(tmp, "stopped.pid").read_text()), signal.SIGKILL)
    if mode == "plain":
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
