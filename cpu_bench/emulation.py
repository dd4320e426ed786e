"""Emulated device types on CPU: a rank runs at a declared fraction of this machine's speed.

A cluster YAML may give a GPU type an `emulate` entry -- fractions in (0, 1] of this machine's own speed:

    gpu_types:
      h20ish:  {hbm_gb: 2, tflops: 0.02, hbm_tbps: 0.005, dollars_per_hour: 0.05, intra_gbps: 2.0,
                emulate: {compute: 0.25, bandwidth: 0.8, link: 1.0}}

Every rank of that type then pads each measured piece of its work with a sleep, so the piece takes t / fraction
instead of t (duty-cycle throttling): decode steps (memory-bound) by `bandwidth`, prefill and training steps
(compute-bound) by `compute`, weight-sync transfers by `link`. For compute and decode pieces t is the CPU time the
piece cost (WALL_KINDS below), so other ranks sharing the core do not slow an emulated rank further while each gets
at least its fraction of a core. A wait on another rank inside a piece (a pipeline stage's receive) is not work:
the work before it is padded first (Throttle.waiting), so each micro-batch of a slow stage is slow when it runs.
It only ever slows a rank down, is off unless the plan's cluster declares it, and every metric line of an emulated
run says so (`emulated`). The planner prices the type at the fractions of its YAML numbers
(cpu_bench/host.HostSpeeds.speed), so keep those this machine's: a device profile of this machine (`schedule.py profile`)
applies to every emulated type of a cluster (profile_fit.apply_profile).
"""

from __future__ import annotations

import contextlib
import functools
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

    def fraction(self, kind: str) -> float:
        if kind not in KINDS:
            raise EmulationError(f"unknown kind of work {kind!r} (known: {list(KINDS)})")
        return getattr(self, kind)

    @property
    def demand(self) -> float:
        """The most of a core this rank keeps busy: it sleeps 1 - fraction of every piece of CPU work (compute and
        decode; a link piece is mostly a wait on the other end)."""
        return max(self.compute, self.bandwidth)

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


# Compute and decode pieces are CPU work: what they cost is the CPU time the rank's thread spends on them, not the
# wall time, which stretches when other ranks' pieces share the core. Padding to cpu / fraction absorbs that
# contention (as long as the rank gets at least `fraction` of a core meanwhile: HostSpeeds.speed's demand rule), so
# ranks whose bursts coincide -- every rank of a DP group computes at once -- still run at exactly their fraction.
# A link piece is a transfer, mostly waiting on the other end: it is padded by its wall time.
WALL_KINDS = ("link",)


@dataclass
class Throttle:
    """One rank's throttle; `emulation` None makes every call free."""

    emulation: Emulation | None = None
    type_name: str = ""
    slept_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    # the piece in progress: (kind, its wall clock and CPU clock where its unpadded work began)
    _open: tuple[str, float, float] | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self.emulation is not None

    def pad(self, kind: str, seconds: float, cpu_seconds: float | None = None) -> float:
        """A piece of `kind` just took `seconds` of wall time (`cpu_seconds` of this thread's CPU time): sleep so
        that it takes cost / fraction, its cost being its CPU time for compute and bandwidth pieces (its wall time
        for link pieces, or when no CPU time is given). Returns the sleep."""
        return self.pad_split({kind: (seconds, cpu_seconds)}, seconds)

    def pad_split(self, parts: dict[str, tuple[float, float | None]], seconds: float) -> float:
        """One piece of `seconds` wall time made of parts {kind: (wall_s, cpu_s)}: sleep so that it takes the sum of
        each part's cost / its fraction (see pad). The sleep is booked to the parts in proportion to their extra."""
        if self.emulation is None or seconds <= 0:
            return 0.0
        target, extras = 0.0, {}
        for kind, (wall, cpu) in parts.items():
            cost = wall if cpu is None or kind in WALL_KINDS else cpu
            target += cost / self.emulation.fraction(kind)
            extras[kind] = max(0.0, cost / self.emulation.fraction(kind) - wall)
        extra = target - seconds
        if extra <= 0:
            return 0.0
        time.sleep(extra)
        total = sum(extras.values()) or 1.0
        for kind, e in extras.items():
            self.slept_s[kind] += extra * e / total
        return extra

    def generator_step(self, gen) -> list:
        """One generator.Generator step, its prefill part padded by the compute fraction and the rest (decode,
        memory-bound) by the bandwidth fraction; the step's CPU time is split as its wall time is."""
        if self.emulation is None:
            return gen.step()
        prefill_before, t0, c0 = gen.stats.prefill_seconds, time.perf_counter(), time.thread_time()
        outs = gen.step()
        took, cpu = time.perf_counter() - t0, time.thread_time() - c0
        prefill = min(took, gen.stats.prefill_seconds - prefill_before)
        share = prefill / took if took > 0 else 0.0
        self.pad_split({"compute": (prefill, cpu * share), "bandwidth": (took - prefill, cpu * (1 - share))}, took)
        return outs

    def wrapped(self, kind: str, fn):
        """`fn` with every call run as one piece of `kind`."""

        @functools.wraps(fn)
        def padded(*args, **kwargs):
            with self.piece(kind):
                return fn(*args, **kwargs)

        return padded

    @contextlib.contextmanager
    def piece(self, kind: str):
        self._open = (kind, time.perf_counter(), time.thread_time())
        try:
            yield
            self._pad_open()
        finally:
            self._open = None

    @contextlib.contextmanager
    def waiting(self):
        """A wait on another rank inside a piece (a pipeline stage receiving an activation or a gradient): the
        piece's work so far is padded before it, and the wait is not work. So each stretch of work between two waits
        takes as long as on the emulated device, when it runs: a slow pipeline stage's micro-batches are slow when
        the next stage waits for them, and the 1F1B bubble comes out as the device's, not hidden in one pad at the
        end of the step. Outside a piece it does nothing."""
        if self._open is None:
            yield
            return
        self._pad_open()
        try:
            yield
        finally:
            self._open = (self._open[0], time.perf_counter(), time.thread_time())

    def _pad_open(self) -> None:
        """Pads the open piece's work since its clocks were last set."""
        kind, t0, c0 = self._open
        self.pad(kind, time.perf_counter() - t0, time.thread_time() - c0)

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


def wrap_rank(plan: dict, rank: int, role) -> Throttle:
    """Wraps this rank's work once, at setup, when the plan's cluster emulates its GPU type; a rank of any other type
    is left as it is. `role` is what train.py runs on the rank:
      - a train rank (`role.trainer`): each train step is a compute piece, and its pipeline's waits on neighbouring
        stages are not work (Throttle.waiting);
      - the train head (`role.stream_version`): its part of each weight transfer is a link piece, and every step
        line names the plan's emulated types (`emulated`);
      - a rollout rank (`role.run_step`): each generator step is padded as Throttle.generator_step says, and its
        counters carry the sleeps (`throttle_s`, summed by the head as rollout_throttle_s)."""
    throttle = Throttle.for_rank(plan, rank)
    if not throttle.active:
        return throttle
    trainer = getattr(role, "trainer", None)
    if trainer is not None:
        trainer.train_step = throttle.wrapped("compute", trainer.train_step)
        trainer.links.waiting = throttle.waiting
    if hasattr(role, "stream_version"):
        role.stream_version = throttle.wrapped("link", role.stream_version)
        log_step, types = role.log.step, emulated_types(plan)
        role.log.step = lambda metrics: log_step({**metrics, "emulated": types})
    if hasattr(role, "run_step"):
        role.run_step = throttle.generator_step
        counters = role.counters
        role.counters = lambda: {**counters(), "throttle_s": sum(throttle.slept_s.values())}
    return throttle
