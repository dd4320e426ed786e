"""Version-stamped trajectory buffer with AReaL's staleness admission control.

The buffer lives on the train head (train rank 0), which is also the rollout controller: it *admits*
GRPO groups (one prompt, G samples) to rollout ranks, *completes* them when their trajectories arrive,
and *takes* training batches of B groups. Units are groups throughout.

Admission (AReaL Eq. 3): a new group is admitted only while ⌊(N_r − 1)/B⌋ ≤ v + η, i.e. while
N_r ≤ (v + η + 1)·B, where N_r counts admitted groups (including the one being admitted), v is the
trainer version and η = max_staleness. η = 0 is exactly synchronous RL.

Consumption: batches are formed oldest admission first, and a batch at version v must contain every group
admitted at version ≤ v − η (otherwise it would be consumed too stale next step), so the buffer waits
for those. Counting shows they always fit: at most (v + 1)·B groups were admitted at version ≤ v − η and
v·B have been consumed. Every token is generated at a version ≥ its group's admission version (weights
and grants travel in order on one channel), so every token trained at version v is at least v − η.
Each group is consumed exactly once; nothing is dropped (a lost rollout rank's groups are re-queued).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class Trajectory:
    prompt_id: int
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    behav_logprobs: list[float]       # log_softmax(logits / T) of each sampled token, full vocabulary
    versions: list[int]               # policy version that produced each response token
    reward: float
    advantage: float = 0.0
    finish_reason: str = "stop"
    group_id: int = -1
    correct: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        return cls(**d)


@dataclass
class Ticket:
    """One admitted GRPO group."""
    group_id: int
    prompt_id: int
    admit_version: int
    rank: int = -1                     # rollout rank working on it


@dataclass
class StalenessBuffer:
    batch_groups: int                  # B
    max_staleness: int                 # η
    version: int = 0                   # v: number of optimizer steps taken
    num_admitted: int = 0              # N_r (groups), ever admitted, including re-queued re-admissions
    next_group_id: int = 0
    in_flight: dict[int, Ticket] = field(default_factory=dict)
    completed: dict[int, tuple[Ticket, list[Trajectory]]] = field(default_factory=dict)
    requeued: list[Ticket] = field(default_factory=list)     # lost groups waiting to be admitted again

    # -- admission -------------------------------------------------------------------------------
    def capacity(self) -> int:
        """How many more groups may be admitted now."""
        return (self.version + self.max_staleness + 1) * self.batch_groups - self.num_admitted

    def admit(self, prompt_id: int, rank: int) -> Ticket:
        if self.capacity() <= 0:
            raise RuntimeError("admission would exceed the staleness bound")
        if self.requeued:                           # lost work goes first, under its own group id
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
            raise KeyError(f"group {group_id} is not in flight (duplicate or unknown result)")
        ticket = self.in_flight.pop(group_id)
        self.completed[group_id] = (ticket, trajectories)

    def requeue_rank(self, rank: int) -> list[int]:
        """A rollout rank was lost: its in-flight groups go back to the front of the queue."""
        lost = [t for t in self.in_flight.values() if t.rank == rank]
        for t in lost:
            del self.in_flight[t.group_id]
            self.num_admitted -= 1                  # the admission is undone; re-admission counts again
            self.requeued.append(t)
        self.requeued.sort(key=lambda t: t.group_id)
        return [t.group_id for t in lost]

    # -- consumption -----------------------------------------------------------------------------
    def must_consume_now(self, ticket: Ticket) -> bool:
        return ticket.admit_version <= self.version - self.max_staleness

    def ready(self) -> bool:
        if len(self.completed) < self.batch_groups:
            return False
        return not any(self.must_consume_now(t) for t in self.in_flight.values())

    def take(self) -> list[tuple[Ticket, list[Trajectory]]]:
        """The next training batch (B groups, oldest admission first); advances the version."""
        assert self.ready(), "take() called before the batch is ready"
        order = sorted(self.completed, key=lambda g: (self.completed[g][0].admit_version, g))
        batch = [self.completed.pop(g) for g in order[:self.batch_groups]]
        for ticket, _ in batch:
            assert self.version - ticket.admit_version <= self.max_staleness, \
                f"staleness bound broken by group {ticket.group_id}"
        leftover_too_old = [g for g, (t, _) in self.completed.items() if self.must_consume_now(t)]
        assert not leftover_too_old, f"groups {leftover_too_old} would exceed the staleness bound"
        self.version += 1
        return batch

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"batch_groups": self.batch_groups, "max_staleness": self.max_staleness, "version": self.version,
                "num_admitted": self.num_admitted, "next_group_id": self.next_group_id,
                "in_flight": [dataclasses.asdict(t) for t in self.in_flight.values()],
                "completed": [[dataclasses.asdict(t), [x.to_dict() for x in trajs]]
                              for t, trajs in self.completed.values()],
                "requeued": [dataclasses.asdict(t) for t in self.requeued]}

    @classmethod
    def from_state_dict(cls, s: dict) -> "StalenessBuffer":
        """Restore; groups that were in flight when the checkpoint was taken are re-queued."""
        buf = cls(s["batch_groups"], s["max_staleness"], s["version"], s["num_admitted"], s["next_group_id"])
        for t, trajs in s["completed"]:
            ticket = Ticket(**t)
            buf.completed[ticket.group_id] = (ticket, [Trajectory.from_dict(x) for x in trajs])
        buf.requeued = sorted([Ticket(**t) for t in s["requeued"]] + [Ticket(**t) for t in s["in_flight"]],
                              key=lambda t: t.group_id)
        buf.num_admitted -= len(s["in_flight"])
        return buf


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward normalised within its group (population std); all-equal rewards give zeros."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    std = r.std(unbiased=False)
    if std == 0:                       # all equal: no signal (and no 0/0 when eps = 0)
        return [0.0] * len(rewards)
    return ((r - r.mean()) / (std + eps)).tolist()
