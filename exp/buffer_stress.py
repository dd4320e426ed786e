"""Adversarial runs of the staleness buffer: every completion order, rank drops, no exception, no deadlock.

    python exp/buffer_stress.py                     # 1,500 seeded runs: B x eta x order x 25 seeds
    python exp/buffer_stress.py --seeds 5 --consume-order admission

Each run drives buffer.StalenessBuffer as the train head does: admit up to capacity (to random rollout ranks,
only once the current weights are sent), complete in-flight groups in an adversarial order, take every batch
that is ready, and now and then lose a rollout rank (its groups are re-queued and admitted again). Orders:
  long-tail  each group finishes after a lognormal number of ticks (sigma 1.5: a few take 20x the median);
  reverse    the youngest in-flight groups finish first, the oldest last;
  random     a uniformly random in-flight group finishes next.
Checked after every operation: no exception, every trained token produced at >= v - eta, no deadlock (if no
batch is ready, something is in flight or admission has capacity), and at the end every group consumed
exactly once and every admitted group accounted for.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from buffer import CONSUME_ORDERS, StalenessBuffer, Trajectory  # noqa: E402

ORDERS = ("long-tail", "reverse", "random")
BATCHES = (1, 2, 8, 64)
ETAS = (0, 1, 2, 4, 8)


class StressFailure(AssertionError):
    """An invariant of the buffer broke in a stress run."""


def run_once(
    B: int,
    eta: int,
    order: str,
    seed: int,
    drops: bool,
    steps: int = 12,
    ranks: int = 3,
    consume_order: str = "deadline",
) -> dict:
    """One run of `steps` batches; raises StressFailure naming the broken invariant. Returns its counts."""
    rng = random.Random(seed)
    buf = StalenessBuffer(B, eta, consume_order=consume_order)
    finish_at: dict[int, float] = {}  # group -> tick it finishes (long-tail)
    produced_from: dict[int, int] = {}  # group -> weights version its tokens start at
    consumed: list[int] = []
    live_ranks = list(range(ranks))
    next_rank = ranks
    tick = 0
    max_staleness_seen = 0
    while buf.version < steps:
        tick += 1
        if tick > 100 * steps * (eta + 2) * 8:
            raise StressFailure(f"no progress after {tick} ticks at version {buf.version}")
        if buf.weights_version != buf.version and rng.random() < 0.7:  # weights arrive after a while
            buf.weights_sent(buf.version)
        for _ in range(min(buf.capacity(), rng.randint(1, 2 * B))):
            t = buf.admit(prompt_id=rng.randrange(1000), rank=rng.choice(live_ranks))
            produced_from[t.group_id] = buf.weights_version
            finish_at[t.group_id] = tick + math.exp(rng.gauss(0.0, 1.5)) * 3
        if drops and buf.in_flight and rng.random() < 0.03:
            lost = rng.choice(live_ranks)
            buf.requeue_rank(lost)
            live_ranks.remove(lost)
            live_ranks.append(next_rank)  # the launcher's replacement (or the remaining ranks) carry on
            next_rank += 1
        flying = sorted(buf.in_flight)
        if order == "long-tail":
            done = [g for g in flying if finish_at[g] <= tick]
        elif order == "reverse":
            done = flying[::-1][: rng.randint(1, max(1, B // 2))]
        else:
            done = rng.sample(flying, min(len(flying), rng.randint(1, max(1, B // 2))))
        for g in done:
            versions = list(range(produced_from[g], buf.weights_version + 1))  # interruptible rollout
            buf.complete(
                g, [Trajectory(0, 0, [1], [2] * len(versions), [0.0] * len(versions), versions, 0.0, group_id=g)]
            )
        while buf.ready():
            v = buf.version
            batch = buf.take()
            if len(batch) != B:
                raise StressFailure(f"batch of {len(batch)} groups, expected {B}")
            for ticket, trajs in batch:
                oldest = min(min(t.versions) for t in trajs)
                max_staleness_seen = max(max_staleness_seen, v - oldest)
                if consume_order != "completion" and v - oldest > eta:
                    raise StressFailure(
                        f"group {ticket.group_id} trained at v={v} has a token of version "
                        f"{oldest}: older than v - eta = {v - eta}"
                    )
                consumed.append(ticket.group_id)
        if not buf.ready() and not buf.in_flight:
            # nothing will complete: admission must be able to go on once the current weights are sent
            outstanding = len(buf.completed)
            if outstanding >= B or (buf.version + eta + 1) * B - buf.num_admitted <= 0:
                raise StressFailure(
                    f"deadlock at v={buf.version}: {outstanding} completed, none in flight, "
                    f"no batch ready and no capacity"
                )
    if len(consumed) != len(set(consumed)):
        raise StressFailure("a group was consumed twice")
    if buf.num_admitted != len(buf.in_flight) + len(buf.completed) + len(consumed):
        raise StressFailure("admitted groups unaccounted for")
    every = set(consumed) | set(buf.completed) | set(buf.in_flight) | {t.group_id for t in buf.requeued}
    if every != set(range(buf.next_group_id)):
        raise StressFailure("a group was lost")
    return {"ticks": tick, "consumed": len(consumed), "max_staleness": max_staleness_seen}


def sweep(seeds: int, consume_order: str = "deadline", steps: int = 12) -> dict:
    runs = failures = 0
    worst = 0
    for B in BATCHES:
        for eta in ETAS:
            for order in ORDERS:
                for seed in range(seeds):
                    runs += 1
                    try:
                        res = run_once(
                            B, eta, order, seed, drops=seed % 2 == 1, steps=steps, consume_order=consume_order
                        )
                        worst = max(worst, res["max_staleness"] - eta)
                    except Exception as e:  # every failure is reported, not only the first
                        failures += 1
                        print(f"FAIL B={B} eta={eta} order={order} seed={seed}: {type(e).__name__}: {e}")
    return {"runs": runs, "failures": failures, "max_excess_staleness": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=25, help="seeds per (B, eta, order); 25 gives 1,500 runs")
    ap.add_argument("--steps", type=int, default=12, help="batches per run")
    ap.add_argument("--consume-order", default="deadline", choices=CONSUME_ORDERS)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    res = sweep(a.seeds, a.consume_order, a.steps)
    print(
        f"{res['runs']} runs ({a.consume_order}), {res['failures']} failed, "
        f"max staleness beyond eta: {res['max_excess_staleness']}, {time.monotonic() - t0:.1f}s"
    )
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
