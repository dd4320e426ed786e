"""The train head's bookkeeping: plain state its loop (train.py's TrainHead) drives, no messages, no collectives.

Which prompt comes next (DataOrder), which rollout rank gets the next group (RolloutPool) and how many groups may be
admitted under the staleness bound (Admission), which weight versions every replica has acknowledged (WeightAcks),
held-out evaluations in flight (EvalBook), the non-finite-step guard and the metrics of a step. Each is tested on
its own (tests/unit/test_head.py).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from buffer import StalenessBuffer, Trajectory
from checkpoint import CheckpointError
from errors import HexrlError, SetupError
from plan import RolloutReplica
from runlog import peak_memory_bytes


class NonFiniteError(HexrlError, RuntimeError):
    """Too many non-finite steps in a row (train.max_nonfinite_steps)."""


class DataOrder:
    """Which training prompt comes next: a seeded permutation of the train set per epoch. (epoch, position) is
    what checkpoints save, so a resumed run continues the same order."""

    def __init__(self, prompt_ids: list[int], seed: int, epoch: int = 0, position: int = 0):
        if not prompt_ids:
            raise SetupError("the train set is empty: nothing to admit")
        if not 0 <= position <= len(prompt_ids):
            raise CheckpointError(f"data position {position} outside the train set of {len(prompt_ids)} prompts")
        self.prompt_ids, self.seed = list(prompt_ids), seed
        self.epoch, self.position = epoch, position
        self.order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return [self.prompt_ids[i] for i in torch.randperm(len(self.prompt_ids), generator=g).tolist()]

    def next(self) -> int:
        if self.position == len(self.order):
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._permutation(self.epoch)
        self.position += 1
        return self.order[self.position - 1]

    def state_dict(self) -> dict:
        return {"data_epoch": self.epoch, "data_pos": self.position}


class RolloutPool:
    """The rollout replicas as the head sees them, each by its leader rank (the one it talks to): live or lost,
    ready or still loading, its planned share, how many granted groups it has not finished, the counters it
    reported last."""

    def __init__(self, replicas: list[RolloutReplica]):
        self.live = [r.leader for r in replicas]
        self.replicas = {r.leader: r for r in replicas}
        self.lost: list[int] = []
        self.ready: set[int] = set()
        self.outstanding = {r: 0 for r in self.live}
        self.counters: dict[int, dict] = {r: {} for r in self.live}

    def next_rank(self, max_queued: int) -> int | None:
        """Where the next group goes: the live replica whose queue is shortest for its planned share, i.e. the
        smallest (unfinished + 1) / share among those with fewer than `max_queued` unfinished groups. The plan
        guides (a replica planned for twice the tokens holds twice the queue) without letting a slow replica
        stall the run: a replica that runs dry is next in line whatever its share. None when all are full."""
        open_ranks = [r for r in self.live if self.outstanding[r] < max_queued]
        if not open_ranks:
            return None
        return min(open_ranks, key=lambda r: (self.outstanding[r] + 1) / max(self.replicas[r].share, 1e-9))

    def token_shares(self) -> dict[int, float]:
        """Each replica's measured share of the tokens generated since this launch, by replica id; none before a
        replica has reported any (a resumed run's first batch can be all restored groups: no share is measured)."""
        total = self.total("generated_tokens")
        if not total:
            return {}
        return {self.replicas[r].id: c.get("generated_tokens", 0) / total for r, c in self.counters.items()}

    def lost_ranks(self) -> list[int]:
        """Every rank of the lost replicas (followers too: they wait on their leader)."""
        return sorted(rank for leader in self.lost for rank in self.replicas[leader].ranks)

    def granted(self, rank: int) -> None:
        self.outstanding[rank] += 1

    def finished(self, rank: int) -> None:
        self.outstanding[rank] -= 1

    def report(self, rank: int, counters: dict) -> None:
        if rank in self.counters:
            self.counters[rank] = counters

    def not_ready(self) -> list[int]:
        return [r for r in self.live if r not in self.ready]

    def stuck(self, silent: list[int], owes_eval) -> list[int]:
        """Silent live ranks that owe work (groups, or answers to an evaluation: `owes_eval(rank)`); a silent
        rank that owes nothing is just idle."""
        return [r for r in silent if r in self.live and (self.outstanding[r] > 0 or owes_eval(r))]

    def drop(self, rank: int) -> None:
        self.live.remove(rank)
        self.lost.append(rank)
        del self.outstanding[rank]

    def maximum(self, key: str) -> float:
        """A counter's largest value over the rollout ranks."""
        return max((c.get(key, 0) for c in self.counters.values()), default=0)

    def total(self, key: str) -> float:
        """A counter summed over the rollout ranks (their latest reports, lost ranks included)."""
        return sum(c.get(key, 0) for c in self.counters.values())

    def idle_fraction(self) -> float:
        """Mean over the ranks that reported of the fraction of their time spent without work."""
        fracs = [c["idle_s"] / max(c["elapsed_s"], 1e-9) for c in self.counters.values() if c]
        return sum(fracs) / max(len(fracs), 1)


class WeightAcks:
    """When a weight version reached every live replica: the seconds from the start of its sync to the last
    leader's `weights_ok`. The head's weight_sync_s ends with its own sends; a replica may still be receiving then
    (another owner's buckets) or applying, and it generates at the new version only after that -- at eta = 0 every
    step waits for it. `ready_s` is the latest version every replica acknowledged (None before the first)."""

    def __init__(self):
        self.pending: dict[int, tuple[float, set[int]]] = {}  # version -> (sync start, leaders yet to acknowledge)
        self.ready_s: float | None = None

    def started(self, version: int, leaders: list[int], now: float | None = None) -> None:
        self.pending[version] = (time.monotonic() if now is None else now, set(leaders))
        self._settle(now)

    def acked(self, version: int, rank: int, now: float | None = None) -> None:
        if version in self.pending:
            self.pending[version][1].discard(rank)
        self._settle(now)

    def drop(self, rank: int, now: float | None = None) -> None:
        """A lost replica acknowledges nothing more: the versions wait for the others alone."""
        for _, waiting in self.pending.values():
            waiting.discard(rank)
        self._settle(now)

    def _settle(self, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        for version in sorted(self.pending):
            start, waiting = self.pending[version]
            if not waiting:
                self.ready_s = now - start
                # a newer version taken: older ones are moot
                self.pending = {v: p for v, p in self.pending.items() if v > version}


class Admission:
    """Which prompt goes to which rollout replica: re-queued groups first, then the data order, each where
    RolloutPool.next_rank says (planned shares; at most `max_queued` unfinished groups each), as far as the
    staleness bound allows."""

    def __init__(self, buffer: StalenessBuffer, data: DataOrder, pool: RolloutPool, max_queued: int):
        self.buffer, self.data, self.pool, self.max_queued = buffer, data, pool, max_queued

    def grants(self) -> dict[int, list[list[int]]]:
        """-> {rank: [[group_id, prompt_id], ...]}, already admitted to the buffer."""
        grants: dict[int, list] = {}
        while self.buffer.capacity() > 0:
            rank = self.pool.next_rank(self.max_queued)
            if rank is None:
                break
            prompt_id = self.buffer.requeued[0].prompt_id if self.buffer.requeued else self.data.next()
            ticket = self.buffer.admit(prompt_id, rank)
            self.pool.granted(rank)
            grants.setdefault(rank, []).append([ticket.group_id, ticket.prompt_id])
        return grants


class EvalBook:
    """Greedy evaluations in flight: the held-out set split over the live ranks per version, what each rank
    still owes, and the accuracy once every answer (of ranks still live) is in."""

    def __init__(self, test_ids: list[int]):
        self.test_ids = list(test_ids)
        self.pending: dict[int, dict] = {}  # version -> {correct, total, expected, owed: {rank: answers}}
        self.started: set[int] = set()

    def start(self, version: int, ranks: list[int]) -> dict[int, list[int]]:
        """-> {rank: prompt_ids} to evaluate at `version`."""
        shares = {rank: self.test_ids[j :: len(ranks)] for j, rank in enumerate(ranks)}
        owed = {rank: len(ids) for rank, ids in shares.items()}
        self.pending[version] = {"correct": 0, "total": 0, "expected": len(self.test_ids), "owed": owed}
        self.started.add(version)
        return shares

    def record(self, version: int, rank: int, correct: list) -> list[tuple[int, float, int]]:
        if version not in self.pending or self.pending[version]["owed"].get(rank, 0) < len(correct):
            raise HexrlError(
                f"rollout rank {rank} sent {len(correct)} eval answers for version {version} it did not owe"
            )
        ev = self.pending[version]
        ev["correct"] += sum(correct)
        ev["total"] += len(correct)
        ev["owed"][rank] -= len(correct)
        return self.finished()

    def drop_rank(self, rank: int) -> list[tuple[int, float, int]]:
        """A lost rank's unanswered share is no longer expected."""
        for ev in self.pending.values():
            ev["expected"] -= ev["owed"].pop(rank, 0)
        return self.finished()

    def owes(self, rank: int) -> bool:
        return any(ev["owed"].get(rank, 0) > 0 for ev in self.pending.values())

    def finished(self) -> list[tuple[int, float, int]]:
        """Pops complete evaluations -> [(version, accuracy, answers)]; one with no answers at all is dropped."""
        done = [v for v, ev in self.pending.items() if ev["total"] == ev["expected"]]
        out = []
        for v in done:
            ev = self.pending.pop(v)
            if ev["total"]:
                out.append((v, ev["correct"] / ev["total"], ev["total"]))
        return out


class NonFiniteGuard:
    """Skipped non-finite steps: a warning each, NonFiniteError after `limit` in a row."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def record(self, updated: bool, step: int) -> None:
        self.in_a_row = 0 if updated else self.in_a_row + 1
        if updated:
            return
        print(
            f"[rank {dist.get_rank() if dist.is_initialized() else 0}] warning: step {step} had a non-finite loss "
            f"or input; update skipped ({self.in_a_row} in a row, limit {self.limit})",
            file=sys.stderr,
            flush=True,
        )
        if self.in_a_row >= max(self.limit, 1):
            raise NonFiniteError(
                f"{self.in_a_row} non-finite steps in a row (up to step {step}, "
                f"train.max_nonfinite_steps={self.limit}); lower train.lr or check the data and rewards"
            )


class StepMetrics:
    """What each step logs beyond the trainer's own numbers: the batch's rewards and staleness, the step's
    rates, and how idle the trainer and the rollout ranks were."""

    def __init__(self):
        self.start()

    def start(self) -> None:
        self.t_start = self.t_last = time.monotonic()
        self.idle_s = 0.0
        self.generated_tokens = 0.0

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t_start

    def trainer_idle(self, seconds: float) -> None:
        self.idle_s += seconds

    @staticmethod
    def batch(trajs: list[Trajectory], version: int) -> dict:
        """Statistics of a batch trained at `version`."""
        lags = [version - v for t in trajs for v in t.versions]
        lengths = sorted(len(t.response_ids) for t in trajs)
        return {
            "reward_mean": sum(t.reward for t in trajs) / len(trajs),
            "train_accuracy": sum(t.correct for t in trajs) / len(trajs),
            "staleness_max": max(lags, default=0),
            "staleness_mean": sum(lags) / max(len(lags), 1),
            "response_len_mean": sum(lengths) / len(lengths),
            # the output-length distribution P the planner takes as input (its tail sets an eta = 0 step)
            "response_len_p50": lengths[(len(lengths) - 1) // 2],
            "response_len_p90": lengths[(9 * (len(lengths) - 1)) // 10],
            "response_len_max": lengths[-1],
        }

    def step(
        self,
        stats: dict,
        version: int,
        weight_sync_s: float,
        pool: RolloutPool,
        weight_sync: dict | None = None,
    ) -> dict:
        now = time.monotonic()
        step_s, self.t_last = now - self.t_last, now
        generated = pool.total("generated_tokens")
        rates = {
            "step": version,
            "version": version,
            "step_s": step_s,
            "weight_sync_s": weight_sync_s,
            **(weight_sync or {}),  # weight_sync_bytes / _predicted_bytes / _dtype
            "trained_tokens_per_s": stats["trained_tokens"] / step_s,
            "generated_tokens_per_s": (generated - self.generated_tokens) / step_s,
            "rollout_idle_frac": pool.idle_fraction(),
            "trainer_idle_frac": self.idle_s / max(now - self.t_start, 1e-9),
            "reward_s": pool.total("reward_s"),  # counters: seconds since the start, summed over rollout replicas
            "rollout_generate_s": pool.total("generate_s"),  # in generator steps (padding included)
            "rollout_generate_cpu_s": pool.total("generate_cpu_s"),  # their CPU seconds (the rest: padding, waits)
            "rollout_generate_steps": pool.total("generate_steps"),
            "rollout_prefill_s": pool.total("prefill_s"),
            "rollout_prefill_tokens": pool.total("prefill_tokens"),
            "rollout_throttle_s": pool.total("throttle_s"),  # sleeps of emulated device types (0 otherwise)
            "elapsed_s": now - self.t_start,
            "train_peak_memory_bytes": peak_memory_bytes(),  # the train head's (the other train ranks' are alike)
            "rollout_peak_memory_bytes": pool.maximum("peak_memory_bytes"),
            **{f"replica{i}_token_share": share for i, share in pool.token_shares().items()},
            **{f"replica{r.id}_planned_share": r.share for r in pool.replicas.values()},
        }
        self.generated_tokens = generated
        return {**stats, **rates}
