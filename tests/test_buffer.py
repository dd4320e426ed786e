"""Staleness buffer invariants under random producer/consumer interleavings."""
import random

from hypothesis import given, settings, strategies as st

from buffer import StalenessBuffer, Trajectory, group_advantages


def fake_group(ticket, version_now, G=2, first_version=None):
    # tokens are generated at versions between the weights the rank held at admission and now (interruptible
    # rollout); by default those are the admission version's
    first = ticket.admit_version if first_version is None else first_version
    versions = sorted(random.Random(ticket.group_id).choice(range(first, version_now + 1)) for _ in range(3))
    return [Trajectory(ticket.prompt_id, s, [1], [2, 3, 4], [0.0] * 3, versions, 1.0, group_id=ticket.group_id)
            for s in range(G)]


@settings(max_examples=300, deadline=None)
@given(B=st.integers(1, 5), eta=st.integers(0, 4), ranks=st.integers(1, 3),
       ops=st.lists(st.tuples(st.sampled_from(["admit", "finish", "train", "lose", "send_weights"]),
                              st.integers(0, 10**6)), min_size=1, max_size=200))
def test_random_interleavings_keep_every_invariant(B, eta, ranks, ops):
    buf = StalenessBuffer(B, eta)
    prompt_counter = 0
    weights_at_admission: dict[int, int] = {}  # group -> the newest weights the rollout ranks held when admitted
    consumed: list[tuple[int, int]] = []       # (group_id, sample) in consumption order
    finished: set[int] = set()
    for op, x in ops:
        if op == "send_weights":
            buf.weights_sent(buf.version)
        elif op == "admit" and buf.capacity() > 0:
            ticket = buf.admit(prompt_counter, rank=x % ranks)
            weights_at_admission[ticket.group_id] = buf.weights_version
            prompt_counter += 1
            # AReaL Eq. 3 at every admission: floor((N_r - 1) / B) <= v + eta
            assert (buf.num_admitted - 1) // B <= buf.version + eta
        elif op == "finish" and buf.in_flight:
            gid = sorted(buf.in_flight)[x % len(buf.in_flight)]
            buf.complete(gid, fake_group(buf.in_flight[gid], buf.weights_version,
                                         first_version=weights_at_admission[gid]))
            finished.add(gid)
        elif op == "lose" and buf.in_flight:
            buf.requeue_rank(x % ranks)
        elif op == "train" and buf.ready():
            v = buf.version
            batch = buf.take()
            assert len(batch) == B and buf.version == v + 1
            for ticket, trajs in batch:
                for t in trajs:
                    assert v - min(t.versions) <= eta, "a token older than v - eta was trained"
                    consumed.append((t.group_id, t.sample_idx))
    # no duplicate consumption, and nothing lost: every finished group is consumed or still in the buffer
    assert len(consumed) == len(set(consumed))
    consumed_groups = {g for g, _ in consumed}
    assert finished == consumed_groups | set(buf.completed)
    # every admitted group is somewhere
    assert buf.num_admitted == len(buf.in_flight) + len(buf.completed) + len(consumed_groups)


def test_progress_is_always_possible():
    """With capacity used and everything finished, a batch is always ready (no deadlock), for any eta."""
    for B in (1, 3):
        for eta in (0, 1, 4):
            buf = StalenessBuffer(B, eta)
            for _ in range(5 * B):
                buf.weights_sent(buf.version)
                while buf.capacity() > 0:
                    buf.admit(0, 0)
                for gid in list(buf.in_flight):
                    buf.complete(gid, fake_group(buf.in_flight[gid], buf.version))
                assert buf.ready()
                buf.take()


def test_eta_zero_is_synchronous():
    buf = StalenessBuffer(2, 0)
    buf.weights_sent(0)
    a, b = buf.admit(0, 0), buf.admit(1, 0)
    assert buf.capacity() == 0                   # exactly one batch may be in flight
    buf.complete(a.group_id, fake_group(a, 0))
    assert not buf.ready()                       # must wait for the whole batch of this version
    buf.complete(b.group_id, fake_group(b, 0))
    batch = buf.take()
    assert [t.admit_version for t, _ in batch] == [0, 0] and buf.capacity() == 0   # until version 1 is out
    buf.weights_sent(1)
    assert buf.capacity() == 2


def test_oldest_first_and_must_wait_for_stale_groups():
    buf = StalenessBuffer(1, 1)
    buf.weights_sent(0)
    g0 = buf.admit(0, 0)                         # admitted at v=0
    g1 = buf.admit(1, 0)
    buf.complete(g1.group_id, fake_group(g1, 0))
    buf.take()                                   # v: 0 -> 1, consumed g1 (only finished one)
    assert buf.version == 1
    buf.weights_sent(1)
    g2 = buf.admit(2, 0)
    buf.complete(g2.group_id, fake_group(g2, 1))
    # g0 (admitted at 0) must be consumed at v=1 at the latest: the buffer waits for it
    assert not buf.ready()
    buf.complete(g0.group_id, fake_group(g0, 1))
    assert [t.group_id for t, _ in buf.take()] == [g0.group_id]


def test_lost_rank_groups_are_requeued_and_checkpoint_roundtrip():
    buf = StalenessBuffer(2, 2)
    buf.weights_sent(0)
    tickets = [buf.admit(p, rank=p % 2) for p in range(4)]
    buf.complete(tickets[0].group_id, fake_group(tickets[0], 0))
    lost = buf.requeue_rank(1)
    assert lost == [1, 3] and buf.capacity() == 6 - 2
    again = buf.admit(99, rank=0)
    assert (again.group_id, again.prompt_id) == (1, 1)         # same group, same prompt, not a new one
    state = buf.state_dict()
    restored = StalenessBuffer.from_state_dict(state)
    assert restored.capacity() == 0              # nothing is admitted before the restored weights are sent
    # in-flight groups of the checkpoint come back as re-queued work; completed ones stay
    assert sorted(t.group_id for t in restored.requeued) == [1, 2, 3]
    assert set(restored.completed) == {0}
    assert restored.num_admitted == 1 and restored.next_group_id == 4


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert abs(sum(adv)) < 1e-9 and abs(adv[0] - 1.0) < 1e-5
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
