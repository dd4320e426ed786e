"""What a clear error is: the base of every concept's own error type.

Each concept raises one type of its own (ConfigError, PlanError, SpecError, ModelFamilyError, DataError,
StalenessError, CheckpointError, WeightSyncError, PeerTimeout, RewardError, NonFiniteError, RolloutRanksLost, and
SetupError below: a launch that cannot work). The train script ends a run on any of them with one line `[rank R] error: ...` instead
of a traceback, so a new concept's error is handled by deriving from HexrlError, not by editing a list there.
"""

from __future__ import annotations


class HexrlError(Exception):
    """A problem the message names (bad input, a lost peer, a broken invariant)."""

    same_on_every_rank = False  # every rank meets it identically (config, plan, data): only rank 0 prints it
    exit_code = 2


class SetupError(HexrlError, RuntimeError):
    """The launch cannot work: no torchrun, no GPU for a rank, a model path that does not load."""

    same_on_every_rank = True
