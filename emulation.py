"""Emulated device types on CPU: a rank runs at a declared fraction of this machine's speed.

A cluster YAML may give a GPU type an `emulate` entry -- fractions in (0, 1] of this machine's own speed:

    gpu_types:
      h20ish:  {hbm_gb: 2, tflops: 0.005, hbm_tbps: 0.004, dollars_per_hour: 0.05, intra_gbps: 2.0,
                emulate: {compute: 0.25, bandwidth: 0.8, link: 1.0}}

Every rank of that type then pads each measured piece of its work with a sleep, so the piece takes t / fraction
instead of t (duty-cycle throttling): decode steps (memory-bound) by `bandwidth`, prefill and training steps
(compute-bound) by `compute`, weight-sync transfers by `link`. It only ever slows a rank down, is off unless the
plan's cluster declares it, and every metric line of an emulated run says so (`emulated`). The planner prices the
type from its YAML numbers; keep them this machine's profile times the fractions.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from errors import HexrlError

KINDS = ("compute", "bandwidth", "link")


class EmulationError(HexrlError, ValueError):
    """An `emulate` entry that cannot be run."""

    same_on_every_rank = True


@dataclass(frozen=True)
class Emulation:
    compute: float = 1.0  # prefill, training
    bandwidth: float = 1.0  # decode
    link: float = 1.0  # weight sync, trajectories

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, kind)
            if not 0 < value <= 1:
                raise EmulationError(
                    f"emulate.{kind} must be in (0, 1] (a fraction of this machine's speed: emulation only slows "
                    f"a rank down), got {value}"
                )

    @staticmethod
    def from_dict(spec: dict | None, where: str) -> Emulation | None:
        if spec is None:
            return None
        unknown = sorted(set(spec) - set(KINDS))
        if unknown:
            raise EmulationError(f"{where}: unknown emulate keys {unknown} (known: {list(KINDS)})")
        try:
            return Emulation(**{k: float(v) for k, v in spec.items()})
        except (TypeError, ValueError) as e:
            if isinstance(e, EmulationError):
                raise EmulationError(f"{where}: {e}") from None
            raise EmulationError(f"{where}: emulate fractions must be numbers ({e})") from None


@dataclass
class Throttle:
    """One rank's throttle; `emulation` None makes every call free."""

    emulation: Emulation | None = None
    type_name: str = ""
    slept_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    @property
    def active(self) -> bool:
        return self.emulation is not None

    def pad(self, kind: str, seconds: float) -> float:
        """A piece of `kind` just took `seconds`: sleep so it takes seconds / fraction. Returns the sleep."""
        if self.emulation is None or seconds <= 0:
            return 0.0
        extra = seconds * (1.0 / getattr(self.emulation, kind) - 1.0)
        if extra > 0:
            time.sleep(extra)
            self.slept_s[kind] += extra
        return extra

    @contextlib.contextmanager
    def piece(self, kind: str):
        t0 = time.perf_counter()
        yield
        self.pad(kind, time.perf_counter() - t0)

    @staticmethod
    def for_rank(plan: dict, rank: int) -> Throttle:
        """This rank's throttle from the plan: its gpu_type's `emulate` entry in the plan's cluster, if any."""
        cluster = (plan.get("inputs") or {}).get("cluster") or {}
        entry = next((e for e in plan.get("ranks", []) if int(e["rank"]) == rank), {})
        type_name = entry.get("gpu_type", "")
        spec = (cluster.get("gpu_types") or {}).get(type_name, {}).get("emulate")
        return Throttle(Emulation.from_dict(spec, f"gpu_types.{type_name}"), type_name)


def emulated_types(plan: dict) -> list[str]:
    """The plan's GPU types that run emulated (metrics carry them)."""
    types = ((plan.get("inputs") or {}).get("cluster") or {}).get("gpu_types") or {}
    return sorted(name for name, spec in types.items() if spec.get("emulate"))
