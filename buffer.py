"""Version-stamped trajectory buffer: staleness-bounded admission and deadline-feasible consumption.

The buffer lives on the train head (train rank 0), which is also the rollout controller: it *admits*
GRPO groups (one prompt, G samples) to rollout ranks, *completes* them when their trajectories arrive,
and *takes* training batches of exactly B groups. Units are groups throughout; v is the trainer version
(optimizer steps taken), η = max_staleness, and the batch taken at version v is trained at v.

Guarantee (the strict per-token bound): every token trained at version v was produced by weights of
version ≥ v − η, whatever order the groups complete in. It rests on two rules and one ordering fact.

Ordering fact. No group is admitted at v before the rollout ranks hold v's weights (after `take()` the
capacity is 0 until `weights_sent(v)`; weights and grants travel in order on one channel), so every token of
a group is produced at a version ≥ its admission version a. A group's *deadline* is therefore a + η: it must
be in a batch taken at a version ≤ a + η.

Admission (AReaL Eq. 3): a new group is admitted only while ⌊(N_r − 1)/B⌋ ≤ v + η, i.e. while
N_r ≤ (v + η + 1)·B, where N_r counts admitted groups including the new one (a lost rank's admissions are
undone). η = 0 is exactly synchronous RL.

Consumption (deadline scheduling). Call a group *outstanding* while it is admitted and not consumed
(in flight or completed), and let due(d) be the number of outstanding groups with deadline ≤ d. The state
at version v is *feasible* when

    F(v):  due(d) ≤ (d − v + 1)·B  for every d ≥ v,

i.e. the batches at versions v, …, d can still hold every group due by d. A batch at v takes the B completed
groups with the earliest deadlines (ties: lowest group id), and is *ready* only if the state left behind
satisfies F(v + 1): due'(d) ≤ (d − v)·B for every d ≥ v (at d = v: every group due now is in the batch).

Proof that the bound holds, nothing raises and nothing deadlocks:
  1. F holds at the start (nothing outstanding) and after every operation:
     - admission at v adds a group with deadline v + η. It changes due(d) only for d ≥ v + η, where due(d)
       counts every outstanding group (all were admitted at ≤ v): N_r − v·B ≤ (η + 1)·B = (v + η − v + 1)·B
       by the admission rule, and larger d only loosen the bound;
     - a lost rank's groups leave the outstanding set (they are re-queued and admitted again later, with a
       new deadline): every due(d) falls;
     - `take()` happens only when the state it leaves satisfies F(v + 1), by the readiness test.
  2. Every consumed group has deadline ≥ v (F(v) allows no outstanding group due before v), so its admission
     version is ≥ v − η, and by the ordering fact so is every one of its tokens.
  3. Earliest-deadline-first among the completed groups is the best choice: for every d it takes the most
     groups due by d that any B completed groups could, so if some valid batch exists among the completed
     groups, EDF finds it.
  4. No deadlock. If at least B groups are outstanding, EDF over *all* outstanding groups leaves F(v + 1):
     for each d, taken(d) = min(due(d), B), and due(d) − B ≤ (d − v + 1)·B − B. So once every in-flight
     group of that choice completes (or its rank is lost and it is re-admitted), a batch is ready. If fewer
     than B are outstanding, then N_r − v·B < B ≤ (η + 1)·B, so admission has capacity as soon as v's
     weights are sent. Either way progress needs only work in flight or admission, never a wait on itself.
The readiness test is a feasibility test, so `take()` on a ready buffer cannot break the bound; calling it
on a buffer that is not ready is a caller's bug and raises StalenessError (explicit, not an `assert`, so
`python -O` cannot turn it into a silent violation).

`consume_order` picks the rule a run uses; exp/simulate.py measures each (docs/results.md):
  "deadline"   the rule above (default): a younger completed group may go ahead of an older one in flight
               whenever every deadline can still be met;
  "admission"  strict admission order: the batch is the B oldest outstanding groups, and waits for all of
               them (EDF over all outstanding groups, hence always feasible by 4.; the simple special case);
  "completion" plain AReaL: admission is bounded, batches take the B oldest *completed* groups and never
               wait for in-flight ones; a long sample's last tokens may then be older than v − η (kept for
               comparison; it is the only order that does not give the guarantee above).
Each group is consumed exactly once; nothing is dropped (a lost rollout rank's groups are re-queued).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from errors import HexrlError

CONSUME_ORDERS = ("deadline", "admission", "completion")


class StalenessError(HexrlError, RuntimeError):
    """The buffer was asked for something its rules forbid (a caller's bug, or a bad checkpoint)."""


@dataclass
class Trajectory:
    prompt_id: int
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    behav_logprobs: list[float]  # log_softmax(logits / T) of each sampled token, full vocabulary
    versions: list[int]  # policy version that produced each response token
    reward: float
    advantage: float = 0.0
    finish_reason: str = "stop"
    group_id: int = -1
    correct: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        return cls(**d)


@dataclass
class Ticket:
    """One admitted GRPO group."""

    group_id: int
    prompt_id: int
    admit_version: int
    rank: int = -1  # rollout rank working on it


@dataclass
class StalenessBuffer:
    batch_groups: int  # B
    max_staleness: int  # η
    version: int = 0  # v: number of optimizer steps taken
    num_admitted: int = 0  # N_r (groups), ever admitted, including re-queued re-admissions
    next_group_id: int = 0
    consume_order: str = "deadline"  # one of CONSUME_ORDERS
    weights_version: int = -1  # the newest version whose weights were sent to the rollout ranks
    in_flight: dict[int, Ticket] = field(default_factory=dict)
    completed: dict[int, tuple[Ticket, list[Trajectory]]] = field(default_factory=dict)
    requeued: list[Ticket] = field(default_factory=list)  # lost groups waiting to be admitted again
    discarded: list[int] = field(default_factory=list)  # groups dropped on completion (dynamic sampling)

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.max_staleness < 0:
            raise StalenessError(
                f"buffer needs batch_groups >= 1 and max_staleness >= 0, "
                f"got {self.batch_groups} and {self.max_staleness}"
            )
        if self.consume_order not in CONSUME_ORDERS:
            raise StalenessError(f"consume_order must be one of {'|'.join(CONSUME_ORDERS)}, got {self.consume_order!r}")

    # -- admission -------------------------------------------------------------------------------
    def weights_sent(self, version: int) -> None:
        self.weights_version = version

    def capacity(self) -> int:
        """How many more groups may be admitted now."""
        if self.weights_version != self.version:  # it would be generated by older weights than admitted at
            return 0
        return (self.version + self.max_staleness + 1) * self.batch_groups - self.num_admitted

    def admit(self, prompt_id: int, rank: int) -> Ticket:
        if self.capacity() <= 0:
            raise StalenessError("admission would exceed the staleness bound (capacity is 0)")
        if self.requeued:  # lost work goes first, under its own group id
            t = self.requeued.pop(0)
            ticket = Ticket(t.group_id, t.prompt_id, self.version, rank)
        else:
            ticket = Ticket(self.next_group_id, prompt_id, self.version, rank)
            self.next_group_id += 1
        self.num_admitted += 1
        self.in_flight[ticket.group_id] = ticket
        return ticket

    def complete(self, group_id: int, trajectories: list[Trajectory]) -> None:
        if group_id not in self.in_flight:
            raise StalenessError(f"group {group_id} is not in flight (duplicate or unknown result)")
        ticket = self.in_flight.pop(group_id)
        self.completed[group_id] = (ticket, trajectories)

    def discard(self, group_id: int) -> None:
        """A finished group that will not be trained (dynamic sampling: its rewards carry no signal): it is consumed
        -- counted in `discarded`, never admitted again -- and its admission is undone, so a new group takes its
        place. Like a lost rank's re-queue this only removes an outstanding group: every deadline stays meetable."""
        if group_id not in self.in_flight:
            raise StalenessError(f"group {group_id} is not in flight (duplicate or unknown result)")
        del self.in_flight[group_id]
        self.num_admitted -= 1
        self.discarded.append(group_id)

    def requeue_rank(self, rank: int) -> list[int]:
        """A rollout rank was lost: its in-flight groups go back to the front of the queue."""
        lost = [t for t in self.in_flight.values() if t.rank == rank]
        for t in lost:
            del self.in_flight[t.group_id]
            self.num_admitted -= 1  # the admission is undone; re-admission counts again
            self.requeued.append(t)
        self.requeued.sort(key=lambda t: t.group_id)
        return [t.group_id for t in lost]

    # -- consumption -----------------------------------------------------------------------------
    def deadline(self, ticket: Ticket) -> int:
        """The last version whose batch may hold this group."""
        return ticket.admit_version + self.max_staleness

    def _next_batch(self) -> list[int] | None:
        """Group ids of the batch `take()` would return now, or None if no batch may be taken yet."""
        b, v = self.batch_groups, self.version
        if len(self.completed) < b:
            return None
        # earliest deadline first = oldest admission first; ties by group id
        edf = sorted(self.completed, key=lambda g: (self.completed[g][0].admit_version, g))[:b]
        if self.consume_order == "completion":
            return edf
        if self.consume_order == "admission":
            oldest = sorted(
                [*self.in_flight.values(), *(t for t, _ in self.completed.values())],
                key=lambda t: (t.admit_version, t.group_id),
            )[:b]
            return [t.group_id for t in oldest] if all(t.group_id in self.completed for t in oldest) else None
        # F(v + 1) after the batch: due'(d) <= (d - v) * B for every deadline d >= v (deadlines span v..v+η)
        left = [0] * (self.max_staleness + 1)
        for t in [*self.in_flight.values(), *(t for t, _ in self.completed.values())]:
            d = self.deadline(t) - v
            if d < 0:
                raise StalenessError(
                    f"group {t.group_id} (admitted at {t.admit_version}) is past its deadline "
                    f"at version {v}: the buffer's state is corrupt"
                )
            left[d] += 1
        for g in edf:
            left[self.deadline(self.completed[g][0]) - v] -= 1
        due = 0
        for d, n in enumerate(left):
            due += n
            if due > d * b:
                return None
        return edf

    def ready(self) -> bool:
        return self._next_batch() is not None

    def take(self) -> list[tuple[Ticket, list[Trajectory]]]:
        """The next training batch (B groups, earliest deadline first); advances the version."""
        batch = self._next_batch()
        if batch is None:
            raise StalenessError("take() called before a batch is ready (check ready() first)")
        self.version += 1
        return [self.completed.pop(g) for g in batch]

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "batch_groups": self.batch_groups,
            "max_staleness": self.max_staleness,
            "version": self.version,
            "num_admitted": self.num_admitted,
            "next_group_id": self.next_group_id,
            "consume_order": self.consume_order,
            "in_flight": [dataclasses.asdict(t) for t in self.in_flight.values()],
            "completed": [
                [dataclasses.asdict(t), [x.to_dict() for x in trajs]] for t, trajs in self.completed.values()
            ],
            "requeued": [dataclasses.asdict(t) for t in self.requeued],
            "discarded": list(self.discarded),
        }

    @classmethod
    def from_state_dict(cls, s: dict) -> StalenessBuffer:
        """Restore; groups that were in flight when the checkpoint was taken are re-queued."""
        buf = cls(
            s["batch_groups"],
            s["max_staleness"],
            s["version"],
            s["num_admitted"],
            s["next_group_id"],
            s.get("consume_order", "deadline"),
        )
        for t, trajs in s["completed"]:
            ticket = Ticket(**t)
            buf.completed[ticket.group_id] = (ticket, [Trajectory.from_dict(x) for x in trajs])
        buf.requeued = sorted(
            [Ticket(**t) for t in s["requeued"]] + [Ticket(**t) for t in s["in_flight"]], key=lambda t: t.group_id
        )
        buf.num_admitted -= len(s["in_flight"])
        buf.discarded = list(s.get("discarded", []))
        return buf


def overlong_penalty(length: int, max_length: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment, added to a response's reward: 0 up to max_length - buffer_tokens, then
    falling linearly to -1 at max_length (and -1 beyond)."""
    if buffer_tokens <= 0 or length <= max_length - buffer_tokens:
        return 0.0
    return max(-1.0, (max_length - buffer_tokens - length) / buffer_tokens)


def zero_variance(rewards: list[float]) -> bool:
    """All rewards of a group equal: GRPO advantages are all 0, the group teaches nothing."""
    return max(rewards) == min(rewards)


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward normalised within its group (population std); all-equal rewards give zeros."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    std = r.std(unbiased=False)
    if std == 0:  # all equal: no signal (and no 0/0 when eps = 0)
        return [0.0] * len(rewards)
    return ((r - r.mean()) / (std + eps)).tolist()
