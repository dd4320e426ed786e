"""The train head's bookkeeping on its own: data order, admission and rollout-rank load and liveness, evaluations
in flight, weight acknowledgements, the non-finite policy and step metrics. No channel, no process group."""

import random

import pytest

from buffer import StalenessBuffer, Trajectory
from checkpoint import CheckpointError
from errors import HexrlError, SetupError
from head import Admission, DataOrder, EvalBook, NonFiniteError, NonFiniteGuard, RolloutPool, StepMetrics, WeightAcks
from plan import RolloutReplica


# ---------------------------------------------------------------------------------------------- data order
def test_data_order_is_a_permutation_per_epoch_and_seeded():
    ids = list(range(100, 137))
    order = DataOrder(ids, seed=3)
    epochs = [[order.next() for _ in ids] for _ in range(3)]
    assert all(sorted(e) == ids for e in epochs)  # every prompt exactly once per epoch
    assert epochs[0] != epochs[1] != epochs[2]
    again = DataOrder(ids, seed=3)
    assert [again.next() for _ in range(3 * len(ids))] == sum(epochs, [])
    other = DataOrder(ids, seed=4)
    assert [other.next() for _ in ids] != epochs[0]


@pytest.mark.parametrize("stop_at", [0, 1, 36, 37, 38, 80])
def test_data_order_resumes_where_its_state_says(stop_at):
    ids = list(range(37))
    a = DataOrder(ids, seed=0)
    for _ in range(stop_at):
        a.next()
    s = a.state_dict()
    b = DataOrder(ids, seed=0, epoch=s["data_epoch"], position=s["data_pos"])
    assert [a.next() for _ in range(50)] == [b.next() for _ in range(50)]


def test_data_order_refuses_an_empty_set_and_a_bad_position():
    with pytest.raises(SetupError, match="train set is empty"):
        DataOrder([], seed=0)
    with pytest.raises(CheckpointError, match="data position 5 outside"):
        DataOrder([1, 2, 3], seed=0, position=5)


# ---------------------------------------------------------------------------------------------- admission + pool
def pool_of(ranks, shares=None):
    """TP-1 replicas on `ranks`, equal shares unless given."""
    shares = shares or [1 / len(ranks)] * len(ranks)
    return RolloutPool([RolloutReplica(i, [r], share) for i, (r, share) in enumerate(zip(ranks, shares))])


def make_admission(ranks, batch=2, eta=1, max_queued=16, n_prompts=50, shares=None):
    buffer = StalenessBuffer(batch, eta)
    buffer.weights_sent(0)
    pool = pool_of(ranks, shares)
    return buffer, pool, Admission(buffer, DataOrder(list(range(n_prompts)), seed=0), pool, max_queued)


def test_admission_fills_the_staleness_capacity_least_loaded_first():
    buffer, pool, admission = make_admission([1, 2, 3], batch=2, eta=1)
    grants = admission.grants()
    assert sum(len(g) for g in grants.values()) == (0 + 1 + 1) * 2  # (v + eta + 1) * B
    assert max(pool.outstanding.values()) - min(pool.outstanding.values()) <= 1
    assert admission.grants() == {}  # nothing more until a version is consumed
    ids = [gid for g in grants.values() for gid, _ in g]
    assert sorted(ids) == list(range(4)) and {t.rank for t in buffer.in_flight.values()} == set(grants)


def test_admission_stops_at_max_queued_per_rank():
    _, pool, admission = make_admission([1, 2], batch=8, eta=4, max_queued=3)
    grants = admission.grants()
    assert {r: len(g) for r, g in grants.items()} == {1: 3, 2: 3}
    pool.finished(2)
    assert {r: len(g) for r, g in admission.grants().items()} == {2: 1}


def test_a_dropped_ranks_groups_go_first_to_the_live_ranks():
    buffer, pool, admission = make_admission([1, 2], batch=2, eta=1)
    grants = admission.grants()
    lost_prompts = sorted(pid for _, pid in grants[2])
    pool.drop(2)
    buffer.requeue_rank(2)
    regrant = admission.grants()
    assert set(regrant) == {1} and sorted(pid for _, pid in regrant[1]) == lost_prompts
    assert pool.live == [1] and pool.lost == [2] and 2 not in pool.outstanding


def test_randomised_admission_never_grants_to_a_lost_rank_or_loses_a_group():
    rng = random.Random(0)
    for trial in range(50):
        ranks = list(range(1, rng.randint(2, 6)))
        buffer, pool, admission = make_admission(ranks, batch=rng.randint(1, 4), eta=rng.randint(0, 3), max_queued=4)
        for _ in range(40):
            for rank in admission.grants():
                assert rank in pool.live
            # complete a random in-flight group, sometimes drop a rank (never the last)
            open_tickets = [t for t in buffer.in_flight.values() if t.rank in pool.live]
            if open_tickets and rng.random() < 0.7:
                t = rng.choice(open_tickets)
                buffer.complete(t.group_id, [Trajectory(t.prompt_id, 0, [1], [2], [0.0], [0], 1.0)])
                pool.finished(t.rank)
            if len(pool.live) > 1 and rng.random() < 0.05:
                rank = rng.choice(pool.live)
                pool.drop(rank)
                buffer.requeue_rank(rank)
            if buffer.ready():
                buffer.take()
                buffer.weights_sent(buffer.version)
            owed = {r: 0 for r in pool.live}
            for t in buffer.in_flight.values():
                assert t.rank in pool.live, (trial, t)
                owed[t.rank] += 1
            assert owed == pool.outstanding, trial  # the pool's load is exactly what the buffer holds per rank


def test_admission_follows_the_planned_shares_and_a_dry_replica_takes_work():
    _, pool, admission = make_admission([1, 2], batch=6, eta=4, max_queued=100, shares=[2 / 3, 1 / 3])
    grants = admission.grants()  # (0 + 4 + 1) * 6 = 30 groups
    assert {r: len(g) for r, g in grants.items()} == {1: 20, 2: 10}
    for _ in range(10):  # replica 2 finishes everything it had: it runs dry
        pool.finished(2)
    assert pool.next_rank(100) == 2  # a dry replica is next in line, whatever its share
    for _ in range(20):
        pool.finished(1)
    assert pool.next_rank(100) == 1  # both dry: the larger share first


def test_replica_token_shares_and_lost_ranks_name_every_member():
    pool = RolloutPool([RolloutReplica(0, [2, 3], 0.5), RolloutReplica(1, [4, 5], 0.5)])
    assert pool.live == [2, 4]  # the head talks to the leaders
    assert pool.token_shares() == {}  # nothing generated yet (a resumed launch's first batch): no share measured
    pool.report(2, {"generated_tokens": 30})
    pool.report(4, {"generated_tokens": 10})
    assert pool.token_shares() == {0: 0.75, 1: 0.25}
    pool.drop(4)
    assert pool.lost_ranks() == [4, 5]


def test_stuck_ranks_are_silent_ones_that_owe_work():
    pool = pool_of([1, 2, 3, 4])
    pool.granted(1)
    assert pool.stuck([1, 2, 3], owes_eval=lambda r: r == 3) == [1, 3]  # 2 is silent but idle; 4 spoke
    pool.drop(1)
    assert pool.stuck([1, 2, 3], owes_eval=lambda r: r == 3) == [3]
    pool.ready.update({2, 3})
    assert pool.not_ready() == [4]


def test_pool_totals_and_idle_fraction_use_the_latest_reports():
    pool = pool_of([1, 2])
    assert pool.idle_fraction() == 0.0 and pool.total("generated_tokens") == 0
    pool.report(1, {"generated_tokens": 10, "idle_s": 1.0, "elapsed_s": 4.0})
    pool.report(1, {"generated_tokens": 30, "idle_s": 1.0, "elapsed_s": 2.0})
    pool.report(2, {"generated_tokens": 5, "idle_s": 0.0, "elapsed_s": 2.0})
    pool.report(9, {"generated_tokens": 1000})  # not a rollout rank
    assert pool.total("generated_tokens") == 35
    assert pool.idle_fraction() == pytest.approx(0.25)


# ---------------------------------------------------------------------------------------------- evaluations
def test_eval_splits_the_held_out_set_once_and_reports_the_accuracy():
    book = EvalBook(list(range(10)))
    shares = book.start(5, [1, 2, 3])
    assert sorted(sum(shares.values(), [])) == list(range(10))
    assert book.owes(1) and book.owes(3)
    assert book.record(5, 1, [1] * len(shares[1])) == []
    assert book.record(5, 2, [0] * len(shares[2])) == []
    done = book.record(5, 3, [1, 0, 1])
    assert done == [(5, (len(shares[1]) + 2) / 10, 10)] and not book.pending and not book.owes(1)
    assert 5 in book.started


def test_a_lost_ranks_share_is_no_longer_expected():
    book = EvalBook(list(range(9)))
    shares = book.start(0, [1, 2, 3])
    book.record(0, 1, [1, 1, 1])
    assert book.drop_rank(3) == []
    assert book.record(0, 2, [0, 0, 0]) == [(0, 0.5, 6)]
    book.start(1, [1])
    assert book.drop_rank(1) == [] and not book.pending  # nobody left who owes: dropped, not logged
    assert sum(map(len, shares.values())) == 9


def test_unowed_eval_answers_are_an_error():
    book = EvalBook([1, 2])
    book.start(0, [1, 2])
    with pytest.raises(HexrlError, match="did not owe"):
        book.record(0, 1, [1, 1])
    with pytest.raises(HexrlError, match="version 7"):
        book.record(7, 1, [1])


def test_an_empty_held_out_set_finishes_at_once():
    book = EvalBook([])
    book.start(0, [1, 2])
    assert book.finished() == [] and not book.pending


# ---------------------------------------------------------------------------------------------- non-finite
def test_non_finite_guard_stops_after_the_limit_in_a_row(capsys):
    guard = NonFiniteGuard(limit=2)
    guard.record(False, 1)
    guard.record(True, 2)  # the streak resets
    guard.record(False, 3)
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row .*max_nonfinite_steps=2"):
        guard.record(False, 4)
    assert capsys.readouterr().err.count("update skipped") == 3


# ---------------------------------------------------------------------------------------------- metrics
def test_batch_statistics_count_token_staleness_against_the_trained_version():
    trajs = [
        Trajectory(0, 0, [1], [2, 3, 4], [0.0] * 3, [3, 2, 2], 1.0, correct=True),
        Trajectory(0, 1, [1], [5], [0.0], [1], 0.0, correct=False),
    ]
    stats = StepMetrics.batch(trajs, version=3)
    assert stats["staleness_max"] == 2 and stats["staleness_mean"] == pytest.approx((0 + 1 + 1 + 2) / 4)
    assert stats["reward_mean"] == 0.5 and stats["train_accuracy"] == 0.5 and stats["response_len_mean"] == 2
    assert (stats["response_len_p50"], stats["response_len_p90"], stats["response_len_max"]) == (1, 1, 3)


def test_step_rates_count_only_the_tokens_generated_since_the_last_step():
    metrics, pool = StepMetrics(), pool_of([1])
    pool.report(1, {"generated_tokens": 100, "idle_s": 0.0, "elapsed_s": 1.0})
    first = metrics.step({"trained_tokens": 10.0}, 1, 0.5, pool)
    pool.report(1, {"generated_tokens": 150, "idle_s": 0.0, "elapsed_s": 2.0})
    second = metrics.step({"trained_tokens": 10.0}, 2, 0.5, pool)
    assert first["generated_tokens_per_s"] * first["step_s"] == pytest.approx(100)
    assert second["generated_tokens_per_s"] * second["step_s"] == pytest.approx(50)
    assert second["step"] == second["version"] == 2 and second["weight_sync_s"] == 0.5


def test_weight_ready_is_the_last_replicas_acknowledgement_of_the_latest_whole_version():
    acks = WeightAcks()
    acks.started(1, [3, 5], now=10.0)
    acks.acked(1, 3, now=10.2)
    assert acks.ready_s is None  # replica 5 has not taken version 1 yet
    acks.started(2, [3, 5], now=11.0)
    acks.acked(1, 5, now=11.3)
    assert acks.ready_s == pytest.approx(1.3)
    acks.acked(2, 5, now=11.1)
    acks.acked(7, 3, now=11.15)  # an unknown version (a re-send's) changes nothing
    assert acks.ready_s == pytest.approx(1.3)
    acks.drop(3, now=11.2)  # a lost replica: version 2 waits for replica 5 alone, which has it
    assert acks.ready_s == pytest.approx(0.2) and not acks.pending
    acks.started(3, [5], now=12.0)
    acks.started(4, [5], now=12.5)
    acks.acked(4, 5, now=12.6)  # a newer version acknowledged supersedes an older one still pending
    assert acks.ready_s == pytest.approx(0.1) and not acks.pending
