"""Pricing a CPU host that stands in for a cluster: the planner's device speeds on the CPU bench.

A cluster YAML of the CPU bench declares what a GPU cluster has no need of: `host_cores` on a machine (the cores its
processes share) and `emulate` on a GPU type (the fractions of this machine a rank of that type runs at,
cpu_bench/emulation.py). The planner prices every device at its own rates (planner/specs.NominalSpeeds); where the
YAML declares either, planner/specs.cluster_from_dict gives the cluster a HostSpeeds instead, and the planner asks it
the same questions -- the fraction of its rates a device runs at (speed), a replica's decode (decode_speed), and
the step of a split once its speeds settle (settle):
  emulated fraction  a rank of an emulated type runs each kind of work at its fraction (Emulation.fraction)
  core share         the OS time-slices a machine's busy processes over its host_cores, so each gets
                     min(1, host_cores / demand) of a core -- of its FLOP/s, its memory bandwidth and its host time
  busy devices       the demand depends on how many devices are busy at once while one works, which depends on the
                     step being priced: settle prices the split again until they stop changing (CORE_SHARE_ROUNDS)
  decode contention  an emulated type whose device profile timed its decode beside each type's trainers
                     (TypeEfficiency.decode_beside) has its replicas priced at the mean over the split's trainers
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from cpu_bench.emulation import Emulation
from errors import HexrlError

ROLES = ("train", "rollout")  # what a device does in a plan (busy_devices tells them apart)
# Rounds of settle's core-share fixed point: the roles' shares feed each other (a slower replica is busy longer,
# which slows the trainers beside it), 5 pricings on the CPU demo's split at eta 4, one at eta 0
CORE_SHARE_ROUNDS = 12


class HostSpecError(HexrlError, ValueError):
    """A host_cores entry that cannot be priced (planner/specs.py reports it as a SpecError)."""


def parse_emulate(gpu_type: dict, where: str) -> Emulation | None:
    """A YAML gpu_types entry's `emulate` fractions (None without them)."""
    return Emulation.from_dict(gpu_type.get("emulate"), where)


def parse_host_cores(value, where: str) -> float:
    """A YAML machines entry's `host_cores`."""
    try:
        cores = float(value)
    except (TypeError, ValueError):
        cores = math.nan
    if not (math.isfinite(cores) and cores > 0):
        raise HostSpecError(
            f"{where}.host_cores must be a number > 0 (the cores the machine's devices share; leave it out for "
            f"GPUs), got {value!r}"
        )
    return cores


@dataclass(frozen=True)
class HostSpeeds:
    """The device speeds of a cluster's machines on a shared CPU host (the module docstring)."""

    machine_types: tuple[str, ...]  # machine index -> its GPU type
    machine_gpus: tuple[int, ...]  # machine index -> its devices (processes)
    host_cores: tuple[float | None, ...]  # machine index -> the cores its devices share; None: one each
    emulated: dict[str, Emulation] = field(default_factory=dict)  # GPU type -> its fractions of this machine
    # machine -> role ("train", "rollout") -> how many of its devices are busy at once while one of that role works,
    # in the step being priced (busy_devices' estimate); a machine not in it counts every device busy
    busy_devices: dict[int, dict[str, float]] = field(default_factory=dict)
    # GPU type -> how much longer its decode steps take in wall time than its profile's decode fit prices their CPU
    # time at its fractions, beside the trainers of the split being priced (decode_contention); a type not in it: 1
    decode_contention: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ the planner's questions
    def speed(self, machine: int, kind: str = "compute", role: str | None = None) -> float:
        """The fraction of its own rates a device of this machine runs at, for one kind of work (emulation.KINDS:
        "compute" -- training, prefill; "bandwidth" -- decode; "link" -- weight sync) in one role ("train",
        "rollout"; None: the busier of the two): its type's emulated fraction (1 without `emulate`) times its core
        share.

        The core share is min(1, host_cores / demand). A CPU "device" is one process, and a device profile measures
        one process alone on a core; when a machine's busy processes want more cores than it has, the OS time-slices
        them, so each gets host_cores / demand of a core -- of its FLOP/s, of its memory bandwidth and of its host
        time alike. The demand is the number of devices busy at once *while this one works* times what one busy
        device wants: a plain device a whole core, an emulated one at most its largest fraction of one, since it
        sleeps the rest of every piece of work (emulation.Throttle). A device that waits (a rollout rank at the
        staleness bound, a trainer waiting for a batch, every rank of an eta = 0 step while the other side works)
        frees its core meanwhile, so what a device sees depends on its role: busy_devices, which settle estimates
        from the step it prices (a fixed point), and without it every device counts busy.
        No core share on a machine without host_cores."""
        emulate = self.emulated.get(self.machine_types[machine])
        fraction = 1.0 if emulate is None else emulate.fraction(kind)
        cores = self.host_cores[machine]
        if cores is None:
            return fraction
        gpus = float(self.machine_gpus[machine])
        seen = self.busy_devices.get(machine)
        if seen is None:
            busy = gpus
        elif role is None:
            busy = max(seen.values(), default=gpus)
        else:
            if role not in ROLES:
                raise ValueError(f"role {role!r}: one of {ROLES}")
            busy = seen.get(role, gpus)  # no device of the role there: as if every device were busy
        demand = busy * (1.0 if emulate is None else emulate.demand)
        return fraction * (1.0 if demand <= cores else cores / demand)

    def type_speed(self, type_name: str, kind: str = "compute", role: str | None = None) -> float:
        """speed of a GPU type in a role: its slowest machine's among those where the role runs (all of the type's
        where it runs on none, or without an estimate); the planner prices a rollout replica per type, and on every
        shipped cluster the machines of a type have one speed."""
        machines = [i for i, t in enumerate(self.machine_types) if t == type_name]
        if role is not None:
            machines = [i for i in machines if role in self.busy_devices.get(i, {})] or machines
        return min((self.speed(i, kind, role) for i in machines), default=1.0)

    def decode_speed(self, type_name: str) -> float:
        """The fraction of its own decode rate a replica of this type runs at in wall time: type_speed of
        "bandwidth" in the rollout role, or, where the split being priced set the type's decode contention (a
        CPU-emulated type whose profile timed its decode beside each type's trainers), the type's emulated
        fraction over that contention: the contention is the measured wall a step takes beside the trainers
        (its waits for a core included), which replaces the core share's estimate of the same waits."""
        contention = self.decode_contention.get(type_name)
        if contention is None:
            return self.type_speed(type_name, "bandwidth", "rollout")
        emulate = self.emulated.get(type_name)
        return (1.0 if emulate is None else emulate.fraction("bandwidth")) / contention

    def settle(self, planner, train_counts: tuple[int, ...], exhaustive: bool):
        """The Evaluation of one split (planner/search.Planner) once the speeds it is priced at settle. The core
        share each device gets depends on how many are busy at once, which depends on the step being priced: the
        split is priced again with the busy devices of the last pricing (busy_devices) until they settle -- at once
        on a single machine, where every time scales with the one share and the busy fractions do not change. A
        CPU-emulated type whose profile measured its decode beside each type's trainers
        (TypeEfficiency.decode_beside) has its replicas priced at the contention of this split's trainers."""
        contention = decode_contention(planner.eff, planner.per_type(train_counts))
        pricer = planner
        if contention != self.decode_contention:
            pricer = planner.priced_at(self.with_busy_devices(self.busy_devices, contention))
        ev = pricer.price(train_counts, exhaustive)
        ev.host_pricing = {"decode_contention": contention} if contention else {}
        shared = any(c is not None for c in self.host_cores)
        for _ in range(CORE_SHARE_ROUNDS if shared else 0):
            if not math.isfinite(ev.step_s):
                break
            busy = busy_devices(planner, ev)
            before = pricer.cluster.speeds.busy_devices
            if all(
                abs(b - before.get(m, {}).get(r, -1.0)) < 1e-3 for m, roles in busy.items() for r, b in roles.items()
            ):
                break
            pricer = planner.priced_at(self.with_busy_devices(busy, contention))
            ev = pricer.price(train_counts, exhaustive)
            ev.host_pricing = {"busy_devices": busy, **({"decode_contention": contention} if contention else {})}
        return ev

    # ------------------------------------------------------------------ the same host, another state or machines
    def with_busy_devices(
        self, busy_devices: dict[int, dict[str, float] | float], decode_contention: dict[str, float] | None = None
    ) -> HostSpeeds:
        """The same host with each machine's devices busy at once as given (speed: machine -> role -> devices; a
        number for a machine counts for both roles, as plans made before the roles were told apart record it)
        and, when given, each type's decode contention (decode_speed; else this one's)."""
        contention = self.decode_contention if decode_contention is None else decode_contention
        busy = {
            int(m): {r: float(b) for r in ROLES}
            if isinstance(b, (int, float))
            else {str(r): float(v) for r, v in b.items()}
            for m, b in busy_devices.items()
        }
        return replace(self, busy_devices=busy, decode_contention=dict(contention))

    def unpriced(self) -> HostSpeeds:
        """The host without any split's busy devices or contention."""
        return replace(self, busy_devices={}, decode_contention={})

    def subset(self, kept: list[tuple[int, int]]) -> HostSpeeds:
        """The host of a sub-cluster: `kept` lists (machine index here, devices kept) in the sub-cluster's order."""
        return HostSpeeds(
            tuple(self.machine_types[i] for i, _ in kept),
            tuple(n for _, n in kept),
            tuple(self.host_cores[i] for i, _ in kept),
            dict(self.emulated),
        )

    def cluster_dict(self, d: dict) -> dict:
        """A cluster dict (planner/specs.Cluster.to_dict) with this host's entries: the run's ranks read `emulate`
        from the plan (cpu_bench/emulation.py), and a plan read back is priced on the same host."""
        for name, g in d["gpu_types"].items():
            if name in self.emulated:
                g["emulate"] = {k: getattr(self.emulated[name], k) for k in ("compute", "bandwidth", "link")}
        for m, cores in zip(d["machines"], self.host_cores):
            if cores is not None:
                m["host_cores"] = cores
        return d


def decode_contention(eff, train_gpus: dict[str, int]) -> dict[str, float]:
    """GPU type -> its decode contention beside a split's trainers (HostSpeeds.decode_contention), for each type
    whose efficiency was measured beside neighbours (TypeEfficiency.decode_beside): the mean of its decode_beside
    over the train GPUs, by their types (train_gpus: type -> train GPUs of it). A trainer type it was not measured
    beside counts as its own type's trainers (the profile's co-load); neither measured: 1. Empty where no type has
    decode_beside (a GPU cluster) or there are no trainers."""
    total = sum(train_gpus.values())
    if total <= 0:
        return {}
    out = {}
    for name, te in eff.per_type.items():
        if not te.decode_beside:
            continue
        own = te.decode_beside.get(name, 1.0)
        out[name] = sum(n * te.decode_beside.get(t, own) for t, n in train_gpus.items()) / total
    return out


def busy_devices(planner, ev) -> dict[int, dict[str, float]]:
    """Machine -> role -> its devices busy at once while one of that role works, in the step `ev` prices
    (HostSpeeds.speed). Each device's busy fraction of the step: a train GPU's for its stage's own work (not the
    1F1B bubble) and the train side's weight sync, a rollout GPU's for generation, reward and the sync until its
    replicas hold the version; a GPU in neither role idles. While one device works:
      - the devices in lockstep with it work too: its stage's other DP and TP ranks (they meet at every
        collective) or, for a replica, the other replicas (gated together: by the weight version they wait for
        and the batches that version releases), so a replica busy a third of the step decodes beside the other
        replicas, not beside a third of them;
      - a train rank of another pipeline stage works as much of this stage's work as the train step's span
        forces them to share: (own + other - span) / own, at least 0 (the 1F1B schedule: both work in its
        steady phase, one alone in the other's bubble);
      - the other role's devices work their busy fraction, independent of it (eta > 0: the two sides overlap
        freely), or not at all (eta = 0: the step runs them back to back).
    A machine's value for the train role is the mean over its train ranks. A device's own idle time frees its
    core for the others but is no relief while it works: a replica busy a third of the step decodes while the
    trainers and the other replicas do, so each device counts the devices busy while it works, not their mean."""
    step = ev.step_s
    work = ev.train.stage_busy_s or [ev.train_s] * len(ev.train.stages)
    rollout_busy = min(1.0, (ev.rollout_s + planner.wl.reward_s + ev.sync_s) / step)
    # machine -> stage -> its ranks there
    ranks: dict[int, dict[int, int]] = {m.index: {} for m in planner.cluster.machines}
    replicas: dict[int, int] = {m.index: 0 for m in planner.cluster.machines}
    for k, (_, _, ids) in enumerate(ev.train.stages):
        for i in ids:
            ranks[planner.gpu_machine[i]][k] = ranks[planner.gpu_machine[i]].get(k, 0) + 1
    for _, ids in ev.rollout.replicas:
        for i in ids:
            replicas[planner.gpu_machine[i]] += 1
    stage_busy = [min(1.0, (w + ev.train_sync_s) / step) for w in work]  # of the step

    def together(k: int, j: int) -> float:
        """Of stage k's work, the part stage j works at the same time (the train step's span forces it)."""
        if j == k:
            return 1.0
        if work[k] <= 0:
            return 0.0
        return min(1.0, max(0.0, work[k] + work[j] - ev.train_s) / work[k])

    overlap = 1.0 if planner.wl.eta > 0 else 0.0
    busy: dict[int, dict[str, float]] = {}
    for m, here in ranks.items():
        busy[m] = {}  # only the roles the machine's devices have (an idle device sees nothing)
        if here:
            rollout_side = overlap * replicas[m] * rollout_busy
            seen = {k: sum(n * together(k, j) for j, n in here.items()) + rollout_side for k in here}
            busy[m]["train"] = sum(n * seen[k] for k, n in here.items()) / sum(here.values())  # over its ranks
        if replicas[m]:
            busy[m]["rollout"] = replicas[m] + overlap * sum(n * stage_busy[k] for k, n in here.items())
    return busy
