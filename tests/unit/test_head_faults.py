"""The train head's fault handling in process (a scripted control channel, no ranks): a relay lost in a sync gets no
work and its mate gets the version again, dynamic sampling drops flat groups into the ledger and refills, a slow
start is not a stuck rank, a rank that never starts is named, and abort() starts no train collective after an error
inside one. The same faults on real runs: tests/e2e/test_fault_tolerance.py."""

from __future__ import annotations

import json
import time

import pytest


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


def make_head(tmp_path, channel, *overrides):
    import types

    import torch

    from checkpoint import CheckpointWriter
    from config import load_config
    from plan import RolloutReplica
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
    groups.owner_ranks, groups.machine_of, groups.link_gbps = [[0]], {r: 0 for r in [0, *channel.peers]}, min
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
    head.command = lambda kind, **_: head.commands.append(kind)  # no train followers in process (no process group)
    return head


def test_a_relay_lost_in_a_sync_gets_no_work_and_its_mate_gets_the_version_again(world_of_one, tmp_path, monkeypatch):
    """Deterministically: the head has taken batch 1 (version 0 -> 1) and streams version 1's weights. Ranks 1 and
    2 share a machine, so rank 1 relays to rank 2; rank 1 never takes its buckets. It is dropped, its groups are
    re-queued, rank 2 gets version 1 again straight from the owners -- and no group is granted before version 1's
    weights are out, or rank 2 would generate version-1 groups with version-0 weights (staleness v - 2 > eta = 1)."""
    import train
    from buffer import Trajectory

    channel = RecordingChannel([1, 2])
    head = make_head(tmp_path, channel, "staleness.max_staleness=1", "dist.rollout_timeout_s=0.3")
    head._sync_layout, head.planned_buckets = {"buckets": [], "verify": True}, []
    rounds = []

    def send_version(trainer, senders, **_):  # rank 1 fails as a relay; any later round goes through
        relays = sorted(senders)
        rounds.append(relays)
        return ([1] if 1 in relays else []), 0

    monkeypatch.setattr(train, "send_version", send_version)
    head.buffer.weights_sent(0)
    head.send_grants()  # (0 + eta + 1) * B = 4 groups, 2 per rank
    assert sorted(t.rank for t in head.buffer.in_flight.values()) == [1, 1, 2, 2]
    head.inbox = DeliveredInbox()
    for ticket in [t for t in head.buffer.in_flight.values() if t.rank == 2]:
        traj = Trajectory(ticket.prompt_id, 0, [1], [2], [0.0], [0], 1.0, group_id=ticket.group_id)
        head.inbox.groups[(2, ticket.group_id)] = [traj]
        head.on_message(2, {"kind": "delivered", "group_id": ticket.group_id, "counters": {}})
    head.buffer.take()  # version 1
    sent_before = len(channel.sent)

    head.sync_weights()
    head.send_grants()  # what run() does next

    assert rounds == [[1], [2]]  # one relay per machine; then the orphaned mate straight from the owners
    after = channel.sent[sent_before:]
    kinds = [(dst, kind) for dst, kind, _ in after]
    assert (1, "abort") in kinds and head.rollout_ranks == [2]
    weights = [(dst, m["source"], m["forward"]) for dst, kind, m in after if kind == "weights"]
    assert weights == [(1, None, [2]), (2, 1, []), (2, None, [])], weights
    last_weights = max(i for i, (_, kind) in enumerate(kinds) if kind == "weights")
    grants = [i for i, (dst, kind) in enumerate(kinds) if kind == "grant"]
    assert grants and all(i > last_weights for i in grants), kinds
    # rank 1's two groups went back to rank 2, re-admitted at version 1, and capacity (1 + eta + 1) * B - 2
    # admitted = 4 filled up with two new groups
    in_flight = head.buffer.in_flight.values()
    assert sorted(t.group_id for t in in_flight) == [0, 2, 4, 5] and {(t.rank, t.admit_version) for t in in_flight} == {
        (2, 1)
    }


def test_dynamic_sampling_drops_flat_groups_into_the_ledger_and_refills(world_of_one, tmp_path):
    """train.dynamic_sampling_max_discards: a delivered group whose rewards are all equal is discarded -- consumed
    once, written to the ledger as dropped, never trained -- and a new group is granted in its place; past the
    per-step limit flat groups are kept (no step can wait forever)."""
    from buffer import Trajectory

    channel = RecordingChannel([1])
    head = make_head(tmp_path, channel, "staleness.max_staleness=0", "train.dynamic_sampling_max_discards=1")
    head.inbox = DeliveredInbox()
    head.buffer.weights_sent(0)
    head.send_grants()  # (0 + 0 + 1) * B = 2 groups
    first = sorted(head.buffer.in_flight)
    assert first == [0, 1]

    def deliver(group_id, rewards):
        ticket = head.buffer.in_flight[group_id]
        head.inbox.groups[(1, group_id)] = [
            Trajectory(ticket.prompt_id, s, [1], [2], [0.0], [0], r, group_id=group_id) for s, r in enumerate(rewards)
        ]
        head.on_message(1, {"kind": "delivered", "group_id": group_id, "counters": {}})

    deliver(0, [1.0])  # one sample: zero variance -> dropped, and group 2 is granted in its place
    assert head.buffer.discarded == [0] and sorted(head.buffer.in_flight) == [1, 2] and head.discarded == 1
    grants = [m["groups"] for dst, kind, m in channel.sent if kind == "grant"]
    assert [g for g, _ in grants[-1]] == [2]
    deliver(1, [0.0])  # flat too, but the limit (1 per step) is reached: kept
    deliver(2, [1.0])
    assert head.buffer.ready() and len(head.buffer.discarded) == 1
    head.log.close()
    ledger = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [(e["group_id"], e.get("dropped"), e["trainer_version"]) for e in ledger] == [(0, "zero_variance", None)]


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
