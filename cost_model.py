"""Analytic cost model for asynchronous RL on heterogeneous GPUs (the inputs of schedule.py).

Everything the planner and the simulator know about time, memory and money lives here:
  cluster spec  -> GPUType / Machine / Cluster     (exp/clusters/*.yaml)
  model spec    -> ModelSpec                       (any Llama/Qwen2/Mistral HF config.json)
  workload      -> Workload                        (batch, lengths, eta, precision)
  efficiencies  -> Efficiency                      (achieved fraction of peak: calibrated, or a device profile)
and the formulas: rollout replica throughput (HexGen-style roofline), memory feasibility, training step
time (Metis-style pipeline model), weight-sync time and reward time. No torch: numbers in, numbers out (device
measurement, `schedule.py profile`, lives in device_profile.py; finish_profile here fits what it measured).
Units: seconds, bytes, FLOPs, tokens. GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import yaml

from cpu_bench.emulation import Emulation
from errors import HexrlError
from parallel.sync_layout import (  # noqa: F401 -- the planner prices the runtime's own layout
    SYNC_CHECKSUM_BYTES,
    Links,
    SyncBucket,
    assign_senders,
    hf_param_table,
    hf_shape,
    param_stage,
    sync_buckets,
    sync_bytes_sent,
)

ROOT = Path(__file__).resolve().parent
MODELS_DIR = ROOT / "exp" / "models"
LINK_LATENCY_S = 1e-5  # alpha of one collective or point-to-point message (HexGen uses 1e-6..1e-5)


class SpecError(HexrlError, ValueError):
    """A cluster, model or workload spec is malformed (names the file and the field)."""

    same_on_every_rank = True


# ----------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class GPUType:
    name: str
    hbm_gb: float  # HBM capacity
    tflops: float  # dense bf16 tensor-core peak
    hbm_tbps: float  # HBM bandwidth
    dollars_per_hour: float
    intra_gbps: float  # GPU<->GPU bandwidth inside one machine (NVLink, one direction)
    # CPU ranks of this type run at these fractions of the machine (emulation.py); the planner prices them so:
    # tflops / hbm_tbps / intra_gbps stay this machine's, Cluster.speed applies the fractions
    emulate: Emulation | None = None


ROLES = ("train", "rollout")  # what a device does in a plan (Cluster.busy_devices tells them apart)


@dataclass(frozen=True)
class Machine:
    index: int
    gpu_type: str
    gpus: int
    # CPU clusters only: the cores this machine's devices (one process each) share. None: every device has its own
    # compute and memory path, as GPUs do. See Cluster.speed.
    host_cores: float | None = None


@dataclass
class Cluster:
    name: str
    gpu_types: dict[str, GPUType]
    machines: list[Machine]
    inter_gbps: dict[tuple[str, str], float]  # unordered type pair -> GB/s
    machine_gbps: dict[tuple[int, int], float] = field(default_factory=dict)  # machine pair override
    # CPU clusters only: machine -> role ("train", "rollout") -> how many of its devices are busy at once while one
    # of that role works, in the step being priced (Planner.busy_devices' estimate); a machine not in it counts every
    # device busy. See speed.
    busy_devices: dict[int, dict[str, float]] = field(default_factory=dict)
    # CPU emulation only: GPU type -> how much longer its decode steps take in wall time than its profile's decode fit
    # prices their CPU time at its fractions, beside the trainers of the split being priced (decode_contention; Planner.evaluate sets it).
    # A type not in it: 1. See decode_speed.
    decode_contention: dict[str, float] = field(default_factory=dict)

    @property
    def n_gpus(self) -> int:
        return sum(m.gpus for m in self.machines)

    def gpu(self, type_name: str) -> GPUType:
        return self.gpu_types[type_name]

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
        frees its core meanwhile, so what a device sees depends on its role: busy_devices, which Planner.evaluate
        estimates from the step it prices (a fixed point), and without it every device counts busy.
        No core share on a machine without host_cores (GPUs do not share their SMs and HBM with each other)."""
        m = self.machines[machine]
        emulate = self.gpu_types[m.gpu_type].emulate
        fraction = 1.0 if emulate is None else emulate.fraction(kind)
        if m.host_cores is None:
            return fraction
        seen = self.busy_devices.get(machine)
        if seen is None:
            busy = float(m.gpus)
        elif role is None:
            busy = max(seen.values(), default=float(m.gpus))
        else:
            if role not in ROLES:
                raise ValueError(f"role {role!r}: one of {ROLES}")
            busy = seen.get(role, float(m.gpus))  # no device of the role there: as if every device were busy
        demand = busy * (1.0 if emulate is None else emulate.demand)
        return fraction * (1.0 if demand <= m.host_cores else m.host_cores / demand)

    def with_busy_devices(
        self, busy_devices: dict[int, dict[str, float] | float], decode_contention: dict[str, float] | None = None
    ) -> Cluster:
        """The same cluster with each machine's devices busy at once as given (Cluster.speed: machine -> role ->
        devices; a number for a machine counts for both roles, as plans made before the roles were told apart record
        it) and, when given, each type's decode contention (decode_speed; else this cluster's)."""
        contention = self.decode_contention if decode_contention is None else decode_contention
        busy = {
            int(m): {r: float(b) for r in ROLES}
            if isinstance(b, (int, float))
            else {str(r): float(v) for r, v in b.items()}
            for m, b in busy_devices.items()
        }
        return Cluster(
            self.name, self.gpu_types, self.machines, self.inter_gbps, self.machine_gbps, busy, dict(contention),
        )  # fmt: skip

    def decode_speed(self, type_name: str) -> float:
        """The fraction of its own decode rate a replica of this type runs at in wall time: type_speed of
        "bandwidth" in the rollout role, or, where the split being priced set the type's decode contention (a
        CPU-emulated type whose profile timed its decode beside each type's trainers), the type's emulated
        fraction over that contention: the contention is the measured wall a step takes beside the trainers
        (its waits for a core included), which replaces the core share's estimate of the same waits."""
        contention = self.decode_contention.get(type_name)
        if contention is None:
            return self.type_speed(type_name, "bandwidth", "rollout")
        emulate = self.gpu_types[type_name].emulate
        return (1.0 if emulate is None else emulate.fraction("bandwidth")) / contention

    def type_speed(self, type_name: str, kind: str = "compute", role: str | None = None) -> float:
        """Cluster.speed of a GPU type in a role: its slowest machine's among those where the role runs (all of the
        type's where it runs on none, or without an estimate); the planner prices a rollout replica per type, and
        on every shipped cluster the machines of a type have one speed."""
        machines = [m.index for m in self.machines if m.gpu_type == type_name]
        if role is not None:
            machines = [i for i in machines if role in self.busy_devices.get(i, {})] or machines
        return min((self.speed(i, kind, role) for i in machines), default=1.0)

    @cached_property
    def links(self) -> Links:
        return Links(
            tuple(m.gpu_type for m in self.machines),
            {k: g.intra_gbps for k, g in self.gpu_types.items()},
            self.inter_gbps,
            self.machine_gbps,
        )

    def link_gbps(self, a: int, b: int) -> float:
        """Bandwidth between one GPU on machine a and one on machine b (a == b: NVLink)."""
        return self.links.gbps(a, b)

    def group_gbps(self, machines: set[int] | list[int]) -> float:
        """Slowest link inside a group of GPUs that lives on these machines."""
        ms = sorted(set(machines))
        if len(ms) == 1:
            return self.link_gbps(ms[0], ms[0])
        return min(self.link_gbps(a, b) for i, a in enumerate(ms) for b in ms[i + 1 :])

    def with_uniform_links(self) -> Cluster:
        """The same machines with every machine pair at its type pair's link (the per-pair overrides dropped)."""
        return Cluster(self.name, dict(self.gpu_types), list(self.machines), dict(self.inter_gbps), {})

    def dollars_per_hour(self) -> float:
        return sum(m.gpus * self.gpu_types[m.gpu_type].dollars_per_hour for m in self.machines)

    def subset(self, machine_counts: dict[int, int]) -> Cluster:
        """The sub-cluster keeping machine_counts[i] GPUs of machine i (0 drops it); machines renumbered."""
        keep = [
            (m, machine_counts.get(m.index, m.gpus)) for m in self.machines if machine_counts.get(m.index, m.gpus) > 0
        ]
        new_index = {m.index: i for i, (m, _) in enumerate(keep)}
        machines = [Machine(i, m.gpu_type, n, m.host_cores) for i, (m, n) in enumerate(keep)]
        overrides = {
            (new_index[a], new_index[b]): v
            for (a, b), v in self.machine_gbps.items()
            if a in new_index and b in new_index
        }
        return Cluster(self.name, dict(self.gpu_types), machines, dict(self.inter_gbps), overrides)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "gpu_types": {
                k: {f: v for f, v in asdict(g).items() if f != "name" and not (f == "emulate" and v is None)}
                for k, g in self.gpu_types.items()
            },
            "machines": [
                {
                    "gpu_type": m.gpu_type,
                    "gpus": m.gpus,
                    **({} if m.host_cores is None else {"host_cores": m.host_cores}),
                }
                for m in self.machines
            ],
            "links": {
                "inter_gbps": {f"{a}-{b}": v for (a, b), v in self.inter_gbps.items()},
                "machine_gbps": [[a, b, v] for (a, b), v in self.machine_gbps.items()],
            },
        }


def cluster_from_dict(spec: dict, source: str = "<dict>", nproc: int | None = None) -> Cluster:
    """Parse the YAML structure documented in exp/clusters/*.yaml; nproc resizes a one-machine cluster."""

    def need(d: dict, key: str, where: str):
        if not isinstance(d, dict) or key not in d:
            raise SpecError(f"{source}: missing '{key}' in {where}")
        return d[key]

    types = {}
    for name, g in need(spec, "gpu_types", "cluster").items():
        try:
            types[name] = GPUType(
                name,
                float(g["hbm_gb"]),
                float(g["tflops"]),
                float(g["hbm_tbps"]),
                float(g["dollars_per_hour"]),
                float(g["intra_gbps"]),
                Emulation.from_dict(g.get("emulate"), f"{source}: gpu_types.{name}"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError(
                f"{source}: gpu_types.{name} needs numeric hbm_gb, tflops, hbm_tbps, "
                f"dollars_per_hour, intra_gbps ({e!r})"
            ) from None
        if min(types[name].hbm_gb, types[name].tflops, types[name].hbm_tbps, types[name].intra_gbps) <= 0:
            raise SpecError(f"{source}: gpu_types.{name} has a non-positive capacity")
    machines: list[Machine] = []
    for i_entry, entry in enumerate(need(spec, "machines", "cluster")):
        t = need(entry, "gpu_type", "a machines entry")
        if t not in types:
            raise SpecError(f"{source}: machine gpu_type '{t}' is not in gpu_types {sorted(types)}")
        gpus, count = int(need(entry, "gpus", "a machines entry")), int(entry.get("count", 1))
        if gpus <= 0 or count <= 0:
            raise SpecError(f"{source}: machine of {t} needs gpus >= 1 and count >= 1")
        cores = entry.get("host_cores")
        if cores is not None:
            try:
                cores = float(cores)
            except (TypeError, ValueError):
                cores = math.nan
            if not (math.isfinite(cores) and cores > 0):
                raise SpecError(
                    f"{source}: machines[{i_entry}].host_cores must be a number > 0 (the cores the machine's "
                    f"devices share; leave it out for GPUs), got {entry['host_cores']!r}"
                )
        machines += [Machine(len(machines) + i, t, gpus, cores) for i in range(count)]
    if not machines:
        raise SpecError(f"{source}: no machines")
    if nproc is not None:
        if len(machines) != 1:
            raise SpecError(
                f"{source}: --gpus/--nproc only resizes a one-machine cluster (this one has {len(machines)})"
            )
        if nproc < 2:
            raise SpecError(f"--gpus/--nproc must be >= 2 (one rollout and one train rank), got {nproc}")
        machines = [Machine(0, machines[0].gpu_type, nproc, machines[0].host_cores)]
    links = spec.get("links", {}) or {}
    inter: dict[tuple[str, str], float] = {}
    for key, v in (links.get("inter_gbps") or {}).items():
        a, _, b = str(key).partition("-")
        if a not in types or b not in types:
            raise SpecError(f"{source}: links.inter_gbps key '{key}' must be 'TYPE-TYPE' of known types")
        inter[tuple(sorted((a, b)))] = float(v)
    present = sorted({m.gpu_type for m in machines})
    for i, a in enumerate(present):
        for b in present[i:]:
            if (a, b) not in inter and (len(machines) > 1):
                raise SpecError(f"{source}: links.inter_gbps lacks '{a}-{b}'")
    overrides = {}
    for a, b, v in links.get("machine_gbps", []) or []:
        overrides[(min(a, b), max(a, b))] = float(v)
    return Cluster(str(spec.get("name", Path(source).stem)), types, machines, inter, overrides)


def load_cluster(path: str | os.PathLike, nproc: int | None = None) -> Cluster:
    p = Path(path)
    if not p.exists() and (ROOT / "exp" / "clusters" / f"{path}.yaml").exists():
        p = ROOT / "exp" / "clusters" / f"{path}.yaml"
    if not p.exists():
        raise SpecError(f"cluster spec not found: {path}")
    with open(p) as f:
        return cluster_from_dict(yaml.safe_load(f), str(p), nproc)


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return (
            self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden + bias
        )

    @property
    def head_params(self) -> int:  # the LM head matmul always runs; it has its own weights only if untied
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def optimizer_params(self) -> int:
        """The parameters train_step_seconds' optimizer term charges a one-stage trainer (its layers, the LM head)."""
        return self.layers * self.layer_params + self.head_params

    def kv_bytes_per_token_layer(self, nbytes: int, tp: int = 1) -> float:
        """K and V of one token in one layer on one TP rank (KV heads replicate once tp > kv_heads)."""
        return 2 * max(self.kv_heads / tp, 1.0) * self.head_dim * nbytes

    def layer_flops_per_token(self, context: float) -> float:
        """Forward FLOPs of one layer for one token: 2 per weight + attention over `context` earlier tokens."""
        return 2 * self.layer_params + 4 * self.heads * self.head_dim * context

    def to_config(self) -> dict:
        return {
            "_name": self.name,
            "num_hidden_layers": self.layers,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "model_type": "qwen2" if self.qkv_bias else "llama",
        }


def model_from_config(cfg: dict, name: str = "model") -> ModelSpec:
    try:
        spec = ModelSpec(name=str(cfg.get("_name", name)), **asdict(hf_shape(cfg)))
    except (KeyError, TypeError, ValueError) as e:
        raise SpecError(f"model config {name}: missing or bad field {e}") from None
    if min(spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.vocab, spec.intermediate) <= 0:
        raise SpecError(f"model config {name}: sizes must be positive")
    return spec


def load_model_spec(ref: str | os.PathLike) -> ModelSpec:
    """A config.json file, a directory holding one, or the name of one shipped in exp/models/."""
    p = Path(ref)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists():
        p = MODELS_DIR / f"{Path(str(ref)).name.lower()}.json"
    if not p.exists():
        shipped = sorted(q.stem for q in MODELS_DIR.glob("*.json"))
        raise SpecError(f"model config not found: {ref} (a config.json path, its directory, or one of {shipped})")
    with open(p) as f:
        return model_from_config(json.load(f), p.parent.name if p.name == "config.json" else p.stem)


# ----------------------------------------------------------------------------- workload


@dataclass
class Workload:
    prompts_per_step: int = 512
    samples_per_prompt: int = 16
    prompt_len: float = 512.0
    gen_samples: list[float] = field(default_factory=lambda: [1024.0])  # output-length distribution P
    eta: int = 4  # staleness bound (AReaL max_head_offpolicyness)
    precision: str = "bf16"
    reward_s: float = 0.0  # profiled reward cost per step (a constant, paper §4.2.2)
    ppo_minibatches: int = 4  # optimizer steps per RL step
    microbatch_tokens: int = 16384  # training micro-batch token budget
    max_batch: int = 256  # cap on concurrent sequences per rollout replica
    train_passes: float = 4.0  # forward+backward = 3 forward passes, +1 for the proximal log-prob recompute
    # rollout.interrupt_mode "recompute": a weight update re-prefills every running sequence's K/V (rollout.py)
    kv_recompute: bool = True

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1:
            raise SpecError("workload: prompts_per_step and samples_per_prompt must be >= 1")
        if self.prompt_len < 0 or not self.gen_samples or min(self.gen_samples) < 1:
            raise SpecError("workload: prompt_len must be >= 0 and generation lengths >= 1")
        if self.eta < 0:
            raise SpecError(f"workload: eta must be >= 0, got {self.eta}")
        if self.precision not in PRECISION_BYTES:
            raise SpecError(f"workload: precision must be one of {sorted(PRECISION_BYTES)}, got {self.precision!r}")
        if self.ppo_minibatches < 1 or self.microbatch_tokens < 1 or self.max_batch < 1:
            raise SpecError("workload: ppo_minibatches, microbatch_tokens and max_batch must be >= 1")
        if not self.train_passes > 0:
            raise SpecError(f"workload: train_passes must be > 0, got {self.train_passes}")
        if not isinstance(self.kv_recompute, bool):
            raise SpecError(f"workload: kv_recompute must be true or false, got {self.kv_recompute!r}")

    @staticmethod
    def from_quantiles(mean: float, quantiles: dict[float, float] | None = None, n: int = 64, **kw) -> Workload:
        """Build P from a mean and a few quantiles {q: length} (piecewise linear, rescaled to the mean)."""
        if not quantiles:
            return Workload(gen_samples=[float(mean)], **kw)
        pts = sorted({0.0: min(quantiles.values()) * 0.5, **quantiles, 1.0: max(quantiles.values())}.items())
        qs = [(i + 0.5) / n for i in range(n)]
        samples = []
        for q in qs:
            for (q0, v0), (q1, v1) in zip(pts, pts[1:]):
                if q0 <= q <= q1:
                    samples.append(v0 + (v1 - v0) * (q - q0) / max(q1 - q0, 1e-12))
                    break
        scale = mean / (sum(samples) / len(samples))
        return Workload(gen_samples=[max(1.0, s * scale) for s in samples], **kw)

    @property
    def batch(self) -> int:  # sequences per RL step (B)
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def gen_mean(self) -> float:
        return sum(self.gen_samples) / len(self.gen_samples)

    @property
    def gen_max(self) -> float:
        return max(self.gen_samples)

    @property
    def decode_context(self) -> float:
        """Mean context a running sequence holds under continuous batching: prompt + E[g^2] / (2 E[g])."""
        g2 = sum(g * g for g in self.gen_samples) / len(self.gen_samples)
        return self.prompt_len + g2 / (2 * self.gen_mean)

    @property
    def tokens_per_step(self) -> float:
        return self.batch * (self.prompt_len + self.gen_mean)

    def to_dict(self) -> dict:
        return asdict(self)


PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


# ----------------------------------------------------------------------------- efficiency


# a decode step's memory and compute times -> its time (TypeEfficiency.decode_combine)
DECODE_COMBINES = {"max": max, "sum": lambda memory_s, compute_s: memory_s + compute_s}


@dataclass
class TypeEfficiency:
    mfu_train: float = 0.35  # achieved / peak FLOP/s in training
    mfu_infer: float = 0.5  # achieved / peak FLOP/s in decode and prefill
    hbm_eff: float = 0.7  # achieved / peak HBM bandwidth in decode
    decode_overhead_s: float = 0.0  # fixed seconds per decode step (launches, sampling, host work; a device profile)
    # fixed seconds per optimizer step beyond the FLOPs and the optimizer's bytes: gradient norm and clipping, zeroing,
    # the step's host work and launches (a device profile fits it: the intercept of its Trainer steps)
    train_overhead_s: float = 0.0
    # achieved / peak FLOP/s of a decode step's compute (batch rows through every layer: small-row GEMMs, sampling);
    # None: mfu_infer, as for prefill (a device profile fits it from its compute-bound decode steps)
    mfu_decode: float | None = None
    # how a decode step's weight/KV reads and its arithmetic combine: "max" -- they overlap, the step is the slower
    # of the two (a GPU: its many warps overlap loads with tensor-core math); "sum" -- they serialise (a CPU core streams the
    # weights and runs the small-row matmuls in one instruction stream). A device profile picks the one its own
    # decode steps fit better (finish_profile)
    decode_combine: str = "max"
    # the work a tensor-parallel rank still does in full, per token, layer and training pass, in hidden-sized tensors
    # streamed at the decode bandwidth (hbm_eff): the norms, residual adds and loss TP does not divide (Megatron
    # replicates them across a TP group) and, on a CPU, each op's host work. A TP stage gains (1 - 1/tp) of it
    # (train_step_seconds); 0 unless a device profile measured a TP step (finish_profile)
    tp_unsplit: float = 0.0
    # fixed seconds per optimizer step a TP rank spends beyond what a TP-1 step's fixed part and 1/tp of its optimizer
    # cost (the gradient norm's all-reduce over the TP group, the replicated parameters' updates, each collective's
    # host work); measured at tp 2 by a device profile, 0 unless it did
    tp_overhead_s: float = 0.0
    # fixed seconds per optimizer step a DP rank spends beyond what a DP-1 step's fixed part, 1/dp of its FLOPs, its
    # optimizer term and the gradient all-reduce over the DP link cost (the all-reduce's host work on a CPU, the wait
    # for the slower rank of the group); measured at dp 2 by a CPU device profile, 0 unless it did
    dp_overhead_s: float = 0.0
    # fixed seconds per micro-batch beyond its FLOPs (each forward and backward's op dispatch and the chunked
    # log-probs' loop on a CPU, kernel launches on a GPU), charged to every micro-batch of every stage; measured by a
    # CPU profile from one step packed into more micro-batches, 0 unless it did
    microbatch_overhead_s: float = 0.0
    # fixed seconds a decode step of more than one row costs beyond a one-row step's decode_overhead_s: on a CPU core
    # a one-row step runs matrix-vector products straight over the weights, a wider one GEMMs that first pack them
    # into blocks (a device profile fits it from its one-row and multi-row steps; 0 unless it did)
    decode_multirow_s: float = 0.0
    # CPU emulation only: neighbour GPU type -> a decode step's wall time with the host's trainers of that type over
    # the CPU time these constants price it at, at this type's bandwidth fraction (a device profile measures it beside
    # each emulated type's trainers: the cores, caches and memory bandwidth shared with them cost the step CPU time
    # and waits for a core the throttle's padding does not absorb). Empty: 1 (a GPU shares nothing with its
    # neighbours). See decode_beside_fit, decode_contention
    decode_beside: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.decode_combine not in DECODE_COMBINES:
            raise SpecError(f"decode_combine must be one of {list(DECODE_COMBINES)}, got {self.decode_combine!r}")

    @property
    def decode_mfu(self) -> float:
        return self.mfu_infer if self.mfu_decode is None else self.mfu_decode


@dataclass
class Efficiency:
    per_type: dict[str, TypeEfficiency] = field(default_factory=dict)
    link_eff: float = 0.5  # achieved / nominal bandwidth of weight-sync transfers
    sync_latency_s: float = 1.0  # fixed cost of one weight update (pause, bucket handshakes, reload)
    mem_frac: float = 0.9  # usable fraction of HBM

    def of(self, type_name: str) -> TypeEfficiency:
        return self.per_type.get(type_name) or self.per_type.get("*") or TypeEfficiency()

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict | None) -> Efficiency:
        d = dict(d or {})
        per = {k: TypeEfficiency(**v) for k, v in (d.pop("per_type", None) or {}).items()}
        return Efficiency(per_type=per, **d)

    @staticmethod
    def load(path: str | os.PathLike | None) -> Efficiency:
        if path is None:
            return Efficiency()
        with open(path) as f:
            return Efficiency.from_dict(yaml.safe_load(f))


def decode_beside_fit(measured: dict | None, gpu: GPUType, te: TypeEfficiency) -> dict[str, float]:
    """TypeEfficiency.decode_beside from a profile's `decode_beside` points (device_profile._decode_beside): for each
    neighbour type, the step's measured wall seconds over what the profile's own decode constants `te` price that
    step's CPU work at (decode_round_s of its model, batch and context on `gpu`) at the type's bandwidth fraction.
    So the fit gives how a step's cost moves with the model, batch and context, and these points, each timed over
    several of its neighbours' steps, give its level beside each type's trainers. {} without the points."""
    if not measured or not measured.get("points"):
        return {}
    spec = model_from_config(measured["model_config"])
    cpu_s = decode_round_s(
        spec, gpu, te, 1, 1, measured["batch"], measured["context"], measured["bytes"], gpu.intra_gbps
    )
    return {name: p["wall_s"] / (cpu_s / measured["fraction"]) for name, p in measured["points"].items()}


def decode_contention(eff: Efficiency, train_gpus: dict[str, int]) -> dict[str, float]:
    """GPU type -> its decode contention beside a split's trainers (Cluster.decode_contention), for each type whose
    efficiency was measured beside neighbours (TypeEfficiency.decode_beside): the mean of its decode_beside over
    the train GPUs, by their types (train_gpus: type -> train GPUs of it). A trainer type it was not measured beside
    counts as its own type's trainers (the profile's co-load); neither measured: 1. Empty where no type has
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


# ----------------------------------------------------------------------------- rollout


def layer_counts(layers: int, parts: int) -> list[int]:
    base, extra = divmod(layers, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class ReplicaCost:
    batch: int  # concurrent sequences that fit (continuous batching)
    round_s: float  # one decode step of the whole batch
    tokens_per_s: float  # h_psi: generated tokens / s
    prefill_tflops: float  # achieved FLOP/s available for prefill (TFLOP/s)


def decode_round_s(
    model: ModelSpec,
    gpu: GPUType,
    eff: TypeEfficiency,
    tp: int,
    pp: int,
    batch: float,
    context: float,
    nbytes: int,
    pp_gbps: float,
    speed: float = 1.0,
) -> float:
    """Time for one decode step of `batch` sequences on a tp x pp replica (roofline per stage).

    Stage k holds l_k layers and serves the batch as pp micro-batches, so per step each of its GPUs reads
      its weights pp times (once per micro-batch): pp * W_k / tp bytes, plus the KV cache of all `batch`
      sequences for its layers: batch * context * kv_layer * l_k bytes          -> / (hbm_tbps * hbm_eff)
    and computes batch * l_k * layer_flops(context) / tp (+ the LM head on the last stage)
                                                                              -> / (tflops * mfu_infer)
    taking the max of the two (a roofline; HexGen adds them), or their sum where the type's `decode_combine` is
    "sum" (a CPU core, whose profile fits that better). TP adds 2 all-reduces of batch*H per layer
    over NVLink; PP adds batch*H bytes per stage boundary. The step time is the slowest stage, plus the type's
    fixed per-step overhead `decode_overhead_s` (0 unless a device profile sets it: `schedule.py profile` fits
    step = bytes / (hbm_tbps * hbm_eff) + decode_overhead_s to the runtime's decode steps), and for more than one
    row `decode_multirow_s` besides (a CPU core's GEMM path; 0 unless a profile fits it). The compute roof is
    at `mfu_decode` (mfu_infer unless a profile fits it from compute-bound decode steps). `speed` is the share of
    its device the replica gets (Cluster.speed: < 1 only for CPU processes sharing cores): the rates and the
    per-step host work all stretch by 1 / speed.
    """
    hbm = gpu.hbm_tbps * 1e12 * eff.hbm_eff * speed
    flops = gpu.tflops * 1e12 * eff.decode_mfu * speed
    combine = DECODE_COMBINES[eff.decode_combine]
    kv_layer = model.kv_bytes_per_token_layer(nbytes, tp)
    stage_layers = layer_counts(model.layers, pp)
    tp_comm = 0.0
    if tp > 1:
        tp_comm = 2 * (LINK_LATENCY_S + 2 * (tp - 1) / tp * batch * model.hidden * nbytes / (gpu.intra_gbps * 1e9))
    pp_comm = LINK_LATENCY_S * pp + batch * model.hidden * nbytes / (pp_gbps * 1e9) if pp > 1 else 0.0
    worst = 0.0
    for k, lk in enumerate(stage_layers):
        head = model.head_params if k == pp - 1 else 0
        weight_bytes = (lk * model.layer_params + head) * nbytes / tp
        mem_bytes = pp * weight_bytes + batch * context * kv_layer * lk
        compute = batch * (lk * model.layer_flops_per_token(context) + 2 * head) / tp
        roof = combine(mem_bytes / hbm, compute / flops)
        worst = max(worst, roof + lk * tp_comm)
    fixed = eff.decode_overhead_s + (eff.decode_multirow_s if batch > 1 else 0.0)
    return worst + pp_comm + fixed / speed


def decode_bytes_per_step(model: ModelSpec, batch: float, context: float, nbytes: int, tp: int = 1) -> float:
    """Bytes one GPU of a TP-tp replica (pp 1) reads in one decode step, as decode_round_s counts them: its
    weights (every layer and the LM head; the embedding is a lookup) plus the KV cache the batch attends to."""
    weights = (model.layers * model.layer_params + model.head_params) * nbytes / tp
    return weights + batch * context * model.kv_bytes_per_token_layer(nbytes, tp) * model.layers


# Rollout memory: what a rollout rank allocates (rollout.Generator; checked against exp/estimate_memory.py, which
# runs it on fake tensors). Per GPU of a TP-tp replica, in the rollout dtype (wl.bytes):
#   weights  the model's weights / tp (before slicing, a TP rank holds the whole model once: the larger counts)
#   kv       the KV pool: 2 * kv_heads / tp * head_dim * bytes per token and layer
#   then the larger of
#   decode   one Generator.step(): a prefill chunk of PREFILL_CHUNK_TOKENS rows (at most the pool's) through a layer,
#            about (DECODE_H_BYTES * hidden + DECODE_I_BYTES * intermediate / tp) bytes per row at 2-byte compute (fitted
#            to the runtime at 7B with tp 1 and 2), plus the fp32 logits of the batch (LOGIT_COPIES_DECODE of them)
#   sync     the weight-sync buckets a replica leader holds at once (SYNC_BUCKETS_ALIVE: the one arriving and the
#            one forwarded to its machine-mates; a TP leader also flattens one for its followers)
PREFILL_CHUNK_TOKENS = 16384  # rollout.Generator's max_prefill_tokens
DECODE_H_BYTES, DECODE_I_BYTES = 15.3, 4.32
LOGIT_COPIES_DECODE = 3
SYNC_BUCKETS_ALIVE = 2


def sync_buffer_bytes(model: ModelSpec, tp: int, bucket_bytes: float, nbytes: int) -> float:
    """Weight-sync buffers alive on a rollout replica leader: SYNC_BUCKETS_ALIVE buckets (+1 under TP), each the
    bucket size or the largest tensor, which travels alone (cost_model.sync_buckets)."""
    largest = max(n for _, n in hf_param_table(model)) * nbytes
    return (SYNC_BUCKETS_ALIVE + (1 if tp > 1 else 0)) * (max(bucket_bytes, largest) + SYNC_CHECKSUM_BYTES)


def replica_memory_parts(
    model: ModelSpec,
    tp: int,
    kv_tokens: float,
    slots: int,
    wl: Workload,
    bucket_bytes: float = 64 * 2**20,
    pp: int = 1,
    stage: int = 0,
) -> dict[str, float]:
    """Peak bytes per GPU of one rollout rank by kind (the estimator's keys) for a KV pool of `kv_tokens` tokens
    shared by `slots` sequences; `peak_bytes` is their total. `stage` of `pp` (a pipelined replica's stage holds its
    layers; the runtime builds pp 1 only)."""
    nbytes = wl.bytes
    lk = layer_counts(model.layers, pp)[stage]
    head = model.head_params if stage == pp - 1 else 0
    embed = model.vocab * model.hidden if stage == 0 and not (model.tied and stage == pp - 1) else 0
    weights = (lk * model.layer_params + head + embed) * nbytes / tp
    kv = kv_tokens * model.kv_bytes_per_token_layer(nbytes, tp) * lk
    rows = min(PREFILL_CHUNK_TOKENS, kv_tokens)  # a step prefills at most one chunk, at most what the pool holds
    decode = rows * (DECODE_H_BYTES * model.hidden + DECODE_I_BYTES * model.intermediate / tp)
    decode *= nbytes / 2
    logits = LOGIT_COPIES_DECODE * 4 * slots * model.vocab if stage == pp - 1 else 0.0
    sync = sync_buffer_bytes(model, tp, bucket_bytes, nbytes)
    step = max(decode + logits, sync)
    parts = {
        "weights": weights,
        "kv": kv,
        "activations": decode if step > sync else 0.0,
        "logits": logits if step > sync else 0.0,
        "sync_buffers": sync if step == sync else 0.0,
    }
    parts["peak_bytes"] = max(weights + kv + step, weights * tp if tp > 1 else 0.0)  # loading: the whole model
    return parts


def replica_memory_batch(
    model: ModelSpec, gpu: GPUType, tp: int, pp: int, wl: Workload, mem_frac: float, bucket_bytes: float = 64 * 2**20
) -> int:
    """Most concurrent sequences that fit on every GPU of the replica within mem_frac of its HBM, by
    replica_memory_parts with a paged pool holding each sequence's mean context (+10% for partly filled blocks)."""
    budget = gpu.hbm_gb * 1e9 * mem_frac
    per_seq = wl.decode_context * 1.1

    def fits(batch: int) -> bool:
        return all(
            replica_memory_parts(model, tp, batch * per_seq, batch, wl, bucket_bytes, pp, k)["peak_bytes"] <= budget
            for k in range(pp)
        )

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def replica_cost(
    model: ModelSpec,
    gpu: GPUType,
    tp: int,
    pp: int,
    wl: Workload,
    eff: Efficiency,
    pp_gbps: float,
    bucket_bytes: float = 64 * 2**20,
    speed: float = 1.0,
    prefill_speed: float | None = None,
) -> ReplicaCost | None:
    """h_psi of one replica (tokens/s at the memory-limited batch), or None if the weights don't fit. `speed`:
    the share of its devices' rates it gets in decode (Cluster.speed of "bandwidth"), `prefill_speed` in prefill
    (of "compute"; default `speed`)."""
    batch = min(replica_memory_batch(model, gpu, tp, pp, wl, eff.mem_frac, bucket_bytes), wl.max_batch)
    if batch < 1:
        return None
    te = eff.of(gpu.name)
    round_s = decode_round_s(model, gpu, te, tp, pp, batch, wl.decode_context, wl.bytes, pp_gbps, speed)
    prefill_speed = speed if prefill_speed is None else prefill_speed
    return ReplicaCost(batch, round_s, batch / round_s, tp * pp * gpu.tflops * te.mfu_infer * prefill_speed)


def rollout_seconds(
    model: ModelSpec,
    wl: Workload,
    tokens_per_s: float,
    prefill_tflops: float,
    tail_tokens_per_s: float,
    running_seqs: float = 0.0,
    train_s: float = 0.0,
) -> float:
    """C_ROLLOUT per step: decode B*E[g] tokens at the aggregate rate Sigma y*h (Eq. 2 with continuous x_psi),
    plus prefill (2 * params FLOPs per prefilled token on the replicas' compute): each GRPO group's prompt once, and
    the K/V a weight update makes the running sequences recompute (recompute_tokens). With eta >= 1 admission keeps
    every replica full while long sequences finish, so the output-length tail is hidden (it shows up as staleness in
    the simulator); with eta = 0 (synchronous) the step waits for its longest sequence: max(g) decode rounds of the
    fastest replica.
    `running_seqs` (the replicas' batches summed) and `train_s` (the train step) say how much a weight update
    interrupts: a rollout side that finishes its batch, recompute included, before the trainer does sits idle at the
    staleness bound when the next version arrives (nothing to recompute); one still busy after the step -- the
    bottleneck -- holds all its running sequences; in between, the recompute grows with the overrun."""
    if tokens_per_s <= 0:
        return math.inf
    flop_s = prefill_tflops * 1e12 / (2 * model.params)  # prefilled tokens / s
    decode = wl.batch * wl.gen_mean / tokens_per_s
    tail = wl.gen_max / tail_tokens_per_s if wl.eta == 0 else 0.0
    base = max(decode, tail) + prompt_prefill_tokens(wl) / flop_s
    full = recompute_tokens(wl, running_seqs) / flop_s
    if full <= 0:
        return base
    return base + full * min(1.0, max(0.0, (base + full - train_s) / full))


def prompt_prefill_tokens(wl: Workload) -> float:
    """Prompt tokens a step's generators prefill, as rollout.Generator does: each GRPO group's prompt once (its
    samples share the prompt's K/V blocks), but its last token, which rides in the first decode step."""
    return wl.prompts_per_step * max(wl.prompt_len - 1.0, 0.0)


def recompute_tokens(wl: Workload, running_seqs: float) -> float:
    """Tokens whose K/V a weight update has `running_seqs` running sequences recompute, as rollout.Generator does in
    "recompute" interrupt mode: each the context it holds (the mean: Workload.decode_context) but its last token,
    once per step. None where no update interrupts decoding (eta = 0: the step waits for every sequence) or the
    run keeps the stale K/V."""
    if wl.eta < 1 or not wl.kv_recompute:
        return 0.0
    return running_seqs * max(wl.decode_context - 1.0, 0.0)


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class StageSpec:
    gpu_type: str
    layers: int
    machines: tuple[int, ...]  # machines its dp*tp GPUs live on
    tp_gbps: float  # slowest link inside a TP group
    dp_gbps: float  # slowest link inside a DP group
    next_gbps: float  # link to the next stage (0 for the last)
    speed: float = 1.0  # Cluster.speed of its slowest machine (< 1 only for CPU processes sharing cores)


# Training memory: what a train rank allocates (parallel/trainer.py under FSDP2, activation checkpointing, chunked
# log-probs and 1F1B; checked against exp/estimate_memory.py, which runs it on fake tensors). Per GPU of stage k
# (l_k layers) with T = microbatch_tokens tokens per micro-batch, in elements of this rank's TP shard of the stage:
#   shard      stage params / tp / dp (fully_shard over DP when dp > 1, else the whole TP shard)
#   weights    4 B * shard (fp32 master) + 2 B * the stage's embedding / LM head (FSDP keeps their bf16 copies for
#              the step) + 2 B * the decoder layer running (FSDP's unsharded copy, or autocast's)
#   grads      4 B * shard;  optimizer  8 B * shard (AdamW's two fp32 moments)
#   inputs     per micro-batch in flight under 1F1B (pp - k of them, as soon as a minibatch has that many): the
#              checkpointed layer inputs, l_k * T * H * r B (r the residual stream's bytes: 2 under FSDP, whose bf16
#              parameters and input casts make it bf16, 4 with fp32 parameters), the fp32 activation received from
#              the previous stage (under FSDP the first layer keeps a bf16 copy of it besides) and the fp32 output
#              sent to the next one (T * H * 4 B each)
#   and the largest of three moments:
#   a layer's backward  its recomputed forward and its gradients, T * (LAYER_H_BYTES * H + LAYER_I_BYTES * I / tp),
#              FSDP's flat all-gather (bf16) and reduce-scatter (fp32) buffers of the layer (6 B per element), and
#              off the first stage the fp32 gradient of the received activation
#   the LM head's backward (last stage)  LOGIT_BYTES * T * V / tp (bf16 logits, the gradient slices of the chunked
#              log-probs and their sum) and T * H * (HEAD_H_BYTES, +4 off the first stage); without FSDP, autocast's
#              bf16 copy of the head's weight (saved for backward)
#   the global grad norm  GRAD_NORM_BYTES per element of the largest gradient (its fp64 copy and square), after the
#              backward: the activations are gone by then
# The per-token constants are fitted to the runtime's first stages at 1.5B (tp 1), 7B and 14B (tp 2, FSDP); every
# rank of the 15 plans in exp/PLANNER.md agrees with exp/estimate_memory.py within a few % (a test checks one small case).
LAYER_H_BYTES, LAYER_I_BYTES = 25.5, 12.3
LOGIT_BYTES = 8.0
HEAD_H_BYTES = 8.5
GRAD_NORM_BYTES = 16.0


def train_memory_parts(
    model: ModelSpec,
    stage_layers: int,
    last: bool,
    first: bool,
    dp: int,
    tp: int,
    pp_rank: int,
    pp: int,
    wl: Workload,
    shard_state: bool = True,
) -> dict[str, float]:
    """Peak bytes per GPU of one train rank by kind (the estimator's keys); `peak_bytes` is their total."""
    T, H = wl.microbatch_tokens, model.hidden
    layer = model.layer_params / tp
    embed = model.vocab * H if first else 0
    head = model.head_params + H if last and not (first and model.tied) else (H if last else 0)
    root = (embed + head) / tp
    fsdp = shard_state and dp > 1
    shard = (stage_layers * layer + root) / (dp if fsdp else 1)
    residual = wl.bytes if fsdp else 4
    in_flight = pp - pp_rank  # 1F1B's most; a step whose minibatches hold fewer micro-batches per DP rank has fewer
    # per micro-batch in flight: the checkpointed layer inputs, the fp32 activation received from the previous stage
    # (FSDP casts it to bf16 for the first layer, which keeps the copy; without FSDP it is the first layer's input)
    # and the fp32 output sent to the next one
    kept = stage_layers * residual + (4 if not first and fsdp else 0) + (0 if last else 4)
    inputs = in_flight * T * H * kept
    exchanged = 0 if first else T * H * 4  # the gradient of the received activation
    layer_moment = (
        inputs
        + exchanged
        + T * (LAYER_H_BYTES * H + LAYER_I_BYTES * model.intermediate / tp)
        + (6 * layer if fsdp else 0)
    )
    logits = LOGIT_BYTES * T * model.vocab / tp
    head_moment = 0.0
    if last:  # without FSDP's bf16 parameters, autocast's bf16 copy of the LM head weight is saved for backward
        head_moment = inputs + T * H * (HEAD_H_BYTES + (0 if first else 4)) + logits
        head_moment += 0 if fsdp else 2 * model.head_params / tp
    # the global grad norm squares each gradient in fp64 (a copy and its square): 16 B per element of the largest
    largest = max(model.vocab * H if first or last else 0, H * model.intermediate) / tp / (dp if fsdp else 1)
    norm_moment = GRAD_NORM_BYTES * largest
    moment = max(("layer", layer_moment + 2 * layer), ("head", head_moment), ("norm", norm_moment), key=lambda x: x[1])
    parts = {
        "weights": 4 * shard + (2 * root if fsdp else 0) + (2 * layer if moment[0] == "layer" else 0),
        "grads": 4 * shard,
        "optimizer": 8 * shard,
        "activations": {"layer": layer_moment, "head": head_moment - logits, "norm": norm_moment}[moment[0]],
        "logits": logits if moment[0] == "head" else 0.0,
    }
    parts["peak_bytes"] = sum(parts.values())
    return parts


def train_step_seconds(
    model: ModelSpec,
    stages: list[StageSpec],
    dp: int,
    tp: int,
    gpu_types: dict[str, GPUType],
    wl: Workload,
    eff: Efficiency,
) -> float:
    """C_TRAIN per RL step (train_step_times' first)."""
    return train_step_times(model, stages, dp, tp, gpu_types, wl, eff)[0]


def train_step_times(
    model: ModelSpec,
    stages: list[StageSpec],
    dp: int,
    tp: int,
    gpu_types: dict[str, GPUType],
    wl: Workload,
    eff: Efficiency,
) -> tuple[float, list[float]]:
    """(seconds, busy_s): C_TRAIN per RL step, and per stage the seconds its devices work in it -- its m
    micro-batches, gradient all-reduce, optimizer and fixed work; the rest of the step is its share of the 1F1B
    bubble, where it idles (what a CPU's shared cores see: Planner.busy_devices).
    The step (Metis-style), for ppo_minibatches optimizer steps over tokens_per_step tokens:
    per micro-batch stage time t_k = train_passes * mb * FLOPs/token of its layers / (tp * tflops * mfu_train)
                                     + TP all-reduces (2 per layer per pass, ring 2(tp-1)/tp * mb*H bytes)
                                     + (1 - 1/tp) * the work TP leaves whole (tp_unsplit hidden-sized tensors per
                                       token, layer and pass at the decode bandwidth)
                                     + PP send of mb*H bytes per pass to the next stage
    pipeline per minibatch = sum_k t_k + (m - 1) * max_k t_k      (1F1B bubble, m micro-batches per replica)
    where a DP rank's share of a minibatch, S = tokens_per_step / (ppo_minibatches * dp), packs into
    m = max(stages, ceil(S / microbatch_tokens)) micro-batches of mb = S / m tokens (the runtime's packing)
    + DP gradient all-reduce 2(dp-1)/dp * fp32 stage grads / tp over the DP link, + optimizer (HBM-bound)
    + the type's fixed seconds per optimizer step `train_overhead_s` (0 unless a device profile sets it: the
    intercept of its Trainer steps, less this optimizer term), at tp > 1 its `tp_overhead_s` and at dp > 1 its
    `dp_overhead_s`.
    A stage's `speed` (Cluster.speed: < 1 only for CPU processes sharing cores) scales its compute, its optimizer
    and its fixed per-step work; the links are not scaled."""
    nbytes = wl.bytes
    context = wl.decode_context  # mean attention span of a token in a packed sequence
    # the runtime packs a DP rank's share of a minibatch into m micro-batches of at most microbatch_tokens, and into
    # at least as many as there are stages (parallel/trainer.py): m of share / m tokens each, not m full ones
    tokens_per_rank = wl.tokens_per_step / wl.ppo_minibatches / dp
    m = max(len(stages), math.ceil(tokens_per_rank / wl.microbatch_tokens))
    mb = tokens_per_rank / m
    passes = wl.train_passes
    times, own = [], []  # per stage: one micro-batch's time, and its optimizer step's own work besides
    dp_sync = opt = fixed = 0.0
    for k, st in enumerate(stages):
        gpu, te = gpu_types[st.gpu_type], eff.of(st.gpu_type)
        last = k == len(stages) - 1
        flops = (
            passes * mb * (st.layers * model.layer_flops_per_token(context) + (2 * model.head_params if last else 0))
        )
        t = flops / (tp * gpu.tflops * 1e12 * te.mfu_train * st.speed) + te.microbatch_overhead_s / st.speed
        if tp > 1:
            ar_bytes = 2 * (tp - 1) / tp * mb * model.hidden * nbytes
            t += 2 * passes * st.layers * (LINK_LATENCY_S + ar_bytes / (st.tp_gbps * 1e9))
            unsplit = passes * mb * st.layers * te.tp_unsplit * model.hidden * nbytes
            t += (1 - 1 / tp) * unsplit / (gpu.hbm_tbps * 1e12 * te.hbm_eff * st.speed)
        if not last:
            t += passes * (LINK_LATENCY_S + mb * model.hidden * nbytes / (st.next_gbps * 1e9))
        times.append(t)
        params = (st.layers * model.layer_params + (model.head_params if last else 0)) / tp
        stage_sync = LINK_LATENCY_S + 2 * (dp - 1) / dp * params * 4 / (st.dp_gbps * 1e9) if dp > 1 else 0.0
        stage_opt = params * (18 + 12 / dp) / (gpu.hbm_tbps * 1e12 * te.hbm_eff * st.speed)
        extra = (te.tp_overhead_s if tp > 1 else 0.0) + (te.dp_overhead_s if dp > 1 else 0.0)
        stage_fixed = (te.train_overhead_s + extra) / st.speed
        dp_sync, opt, fixed = max(dp_sync, stage_sync), max(opt, stage_opt), max(fixed, stage_fixed)
        own.append(stage_sync + stage_opt + stage_fixed)
    pipeline = sum(times) + (m - 1) * max(times)
    busy = [wl.ppo_minibatches * (m * t + o) for t, o in zip(times, own)]
    return wl.ppo_minibatches * (pipeline + dp_sync + opt + fixed), busy


def train_tokens_per_s(wl: Workload, train_s: float) -> float:
    return wl.tokens_per_step / train_s if train_s > 0 else 0.0


# ----------------------------------------------------------------------------- weight sync, step


def sync_times(
    buckets: list[SyncBucket],
    replicas_per_machine: dict[int, int],
    owner_machines: list[list[int]],
    gbps,
    eff: Efficiency,
    speed: float = 1.0,
) -> tuple[float, float]:
    """(send_s, ready_s) of one version as the runtime runs it (parallel/weight_sync.py): each rollout machine's relay
    takes the buckets in order, every stage from the owner assign_senders picks, and forwards each bucket to the
    machine's k - 1 other replicas once it has it, while the next one arrives; it holds at most SYNC_BUCKETS_ALIVE
    (the next receive waits for the forward two buckets back). `gbps(a, b)`: machine-to-machine bandwidth (a == b:
    inside a machine).
      send_s   until every relay has received the last bucket (and every owner sent its stage to each machine it
               serves): what the train ranks pause for
      ready_s  until every replica holds the version: the relay's last forward ends one bucket-forward after its last
               receive at the earliest, so a version of one bucket takes two hops to a machine-mate. The rollout side
               pauses for it, and an eta = 0 step waits for it
    Both add a fixed latency. `speed` (Cluster.speed of the machines involved, < 1 only for CPU processes sharing
    cores) stretches both: on a CPU a bucket's hop is host work (filling, checksumming, socket copies), and a device
    profile measures it on unshared cores."""
    senders = assign_senders(owner_machines, list(replicas_per_machine), gbps)
    send = ready = 0.0
    sending: dict[tuple[int, int], float] = {}
    for m, k in replicas_per_machine.items():
        received = forwarded = 0.0  # when the relay has received / finished forwarding the bucket so far
        alive: deque[float] = deque()  # the end times of the forwards still holding a bucket
        for b in buckets:
            sender = (b.stage, senders[(b.stage, m)])
            seconds = b.wire_bytes / (gbps(owner_machines[b.stage][sender[1]], m) * 1e9)
            sending[sender] = sending.get(sender, 0.0) + seconds
            start = received
            if len(alive) >= SYNC_BUCKETS_ALIVE:
                start = max(start, alive.popleft())
            received = start + seconds
            if k > 1:
                forwarded = max(forwarded, received) + (k - 1) * b.wire_bytes / (gbps(m, m) * 1e9)
                alive.append(forwarded)
        send, ready = max(send, received), max(ready, forwarded, received)
    owners = max(sending.values(), default=0.0)
    fixed, rate = eff.sync_latency_s / speed, eff.link_eff * speed
    return fixed + max(send, owners) / rate, fixed + max(ready, owners) / rate


def sync_seconds(
    buckets: list[SyncBucket],
    replicas_per_machine: dict[int, int],
    owner_machines: list[list[int]],
    gbps,
    eff: Efficiency,
    speed: float = 1.0,
) -> float:
    """C_UPDATE of one version: until every replica holds it (sync_times' ready_s)."""
    return sync_times(buckets, replicas_per_machine, owner_machines, gbps, eff, speed)[1]


def step_seconds(
    rollout_s: float, train_s: float, sync_s: float, wl: Workload, sync_send_s: float | None = None
) -> float:
    """Paper §4.4: step = weight sync + max(rollout + reward, train); eta = 0 runs them back to back. The two sides
    pause for different parts of the sync (sync_times): the rollout side until its replicas hold the version (sync_s),
    the train side until its sends are done (sync_send_s, default sync_s); an eta = 0 step waits for the replicas."""
    if wl.eta == 0:
        return sync_s + rollout_s + wl.reward_s + train_s
    send = sync_s if sync_send_s is None else sync_send_s
    return max(sync_s + rollout_s + wl.reward_s, send + train_s)


# ----------------------------------------------------------------------------- local profile (cpu cluster)


def profile_cpu(seconds: float = 1.5) -> dict[str, float]:
    """Measure one process's matmul FLOP/s and memcpy bandwidth with numpy (< `seconds` in total)."""
    import time

    import numpy as np

    n = 256
    a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        a @ b
        reps += 1
    tflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    src = np.ones(8 * 1024 * 1024, dtype=np.float32)
    dst = np.empty_like(src)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        np.copyto(dst, src)
        reps += 1
    tbps = 2 * src.nbytes * reps / (time.perf_counter() - t0) / 1e12
    return {"tflops": tflops, "hbm_tbps": tbps}


# ----------------------------------------------------------------------------- device profile (schedule.py profile)

# A device profile (exp/profiles/*.yaml, written by `schedule.py profile`) holds what one device achieved running
# torch and the runtime's own code, and the fractions of a cluster GPU type's nominal numbers those rates are: the
# TypeEfficiency of that type. A fraction must lie in (0, PROFILE_MAX_FRACTION] and an overhead in
# [0, PROFILE_MAX_OVERHEAD_S]: a device does not beat its own peak (the 20% slack is for turbo clocks and rounded-down
# nominal numbers), a negative fixed cost is a fit gone wrong, not a device, and so is a fixed cost of more than 10 s
# per decode or optimizer step (a second is already slow for host work). PROFILE_FRACTIONS and decode_overhead_s are
# required; the others are optional (an older profile, or a device where the profile did not measure them).
PROFILE_FRACTIONS = ("mfu_train", "mfu_infer", "hbm_eff")
PROFILE_OPTIONAL_FRACTIONS = ("mfu_decode",)
PROFILE_OVERHEADS = ("decode_overhead_s",)
PROFILE_OPTIONAL_DECODE_OVERHEADS = ("decode_multirow_s",)
PROFILE_OPTIONAL_OVERHEADS = ("train_overhead_s", "tp_overhead_s", "dp_overhead_s", "microbatch_overhead_s")
PROFILE_MAX_FRACTION = 1.2
PROFILE_MAX_OVERHEAD_S = 10.0
# tp_unsplit is a count of hidden-sized tensor passes per token, layer and training pass. A GPU's TP ranks replicate
# about 10-20 (each norm, residual add and dropout reads and writes one, forward and backward); a CPU core adds each
# op's host work, a few hundred at the tiny model's sizes. Past this a TP step's fit is noise or a broken step
PROFILE_MAX_TP_UNSPLIT = 2000.0
# decode_beside: a step's wall time beside one type's trainers over the CPU time the profile's decode fit prices it at,
# at the type's fraction. The throttle pads each step to its CPU time / fraction, so the wall is below that only
# where lighter neighbours leave the step less CPU work than the fit's points had (the bench: 0.91x alone, against
# the profile's mix) or the fit misses the step; under half of it, or past 4x (the rank got under a quarter of the
# core share it is emulated at), is an overloaded or noisy host
PROFILE_DECODE_BESIDE = (0.5, 4.0)
# the optimizer's bytes per parameter as train_step_seconds prices them (dp 1: fp32 master, grads, AdamW moments)
OPTIMIZER_BYTES_DP1 = 18 + 12


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = slope * x + intercept; returns (slope, intercept, r2). Needs two distinct xs."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError(f"fit_line needs >= 2 (x, y) pairs, got {n}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("fit_line needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    syy = sum((y - my) ** 2 for y in ys)
    sse = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, (1.0 - sse / syy) if syy > 0 else 1.0


def fit_rate(work: list[float], seconds: list[float], what: str) -> tuple[float, float, float]:
    """seconds = work / rate + overhead by least squares: (rate, overhead_s, r2). A slope <= 0 has no rate."""
    slope, intercept, r2 = fit_line(work, seconds)
    if slope <= 0:
        raise SpecError(
            f"profile: {what}: time does not grow with the work (slope {slope:.3g} s per unit); "
            "the machine was too noisy for this fit, run it again on a quieter one"
        )
    return 1.0 / slope, intercept, r2


def fit_rate_given_overhead(work: list[float], seconds: list[float], overhead: float, what: str) -> float:
    """The rate of seconds = work / rate + overhead with the overhead known, by least squares through it."""
    num = sum(w * (t - overhead) for w, t in zip(work, seconds))
    if not work or num <= 0:
        raise SpecError(
            f"profile: {what}: the steps are not longer than their fixed overhead ({overhead:.3g} s); "
            "the machine was too noisy for this fit, run it again on a quieter one"
        )
    return sum(w * w for w in work) / num


def fit_relative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """x minimising sum(((row . x) - y) / y)^2 -- least squares on relative errors, so that points of a few ms and
    of a hundred weigh alike -- by the normal equations. Raises ValueError where the columns are linearly dependent."""
    n = len(rows[0])
    scaled = [[v / y for v in row] for row, y in zip(rows, ys)]
    norm = [max(abs(r[j]) for r in scaled) or 1.0 for j in range(n)]  # columns of bytes, FLOPs and 1 alike in size
    scaled = [[v / c for v, c in zip(r, norm)] for r in scaled]
    a = [[sum(r[i] * r[j] for r in scaled) for j in range(n)] + [sum(r[i] for r in scaled)] for i in range(n)]
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) <= 1e-9 * len(rows):
            raise ValueError("fit_relative: the columns are linearly dependent")
        a[col], a[pivot] = a[pivot], a[col]
        for k in range(n):
            if k != col:
                f = a[k][col] / a[col][col]
                a[k] = [u - f * v for u, v in zip(a[k], a[col])]
    return [a[i][n] / a[i][i] / norm[i] for i in range(n)]


def relative_rms(predicted: list[float], measured: list[float]) -> float:
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(predicted, measured)) / len(measured))


def _profile_number(d: dict, key: str, where: str, source: str) -> float:
    try:
        value = float(d[key])
    except (TypeError, ValueError):
        raise SpecError(f"{source}: {where}.{key} must be a number, got {d[key]!r}") from None
    if not math.isfinite(value):
        raise SpecError(f"{source}: {where}.{key} must be finite, got {value}")
    return value


def _check_overhead(value: float, key: str, where: str, source: str, what: str) -> None:
    if value < 0:
        raise SpecError(
            f"{source}: {where}.{key} = {value:.4g} s < 0 is not physically plausible ({what}); the fit was too "
            "noisy, profile again"
        )
    if value > PROFILE_MAX_OVERHEAD_S:
        raise SpecError(
            f"{source}: {where}.{key} = {value:.4g} s > {PROFILE_MAX_OVERHEAD_S:g} s is not physically plausible "
            f"({what}); the fit was too noisy, profile again"
        )


def check_profile_efficiency(eff: dict, source: str) -> TypeEfficiency:
    """The profile's TypeEfficiency, or one SpecError naming the first missing or implausible constant."""
    required = (*PROFILE_FRACTIONS, *PROFILE_OVERHEADS)
    if not isinstance(eff, dict):
        raise SpecError(f"{source}: 'efficiency' must be a mapping of {list(required)}")
    values = {}
    for key in required:
        if key not in eff:
            raise SpecError(f"{source}: missing 'efficiency.{key}'")
        values[key] = _profile_number(eff, key, "efficiency", source)
    for key in (*PROFILE_OPTIONAL_FRACTIONS, *PROFILE_OPTIONAL_OVERHEADS):
        if eff.get(key) is not None:
            values[key] = _profile_number(eff, key, "efficiency", source)
    for key in PROFILE_OPTIONAL_DECODE_OVERHEADS:
        if eff.get(key) is not None:
            values[key] = _profile_number(eff, key, "efficiency", source)
            _check_overhead(values[key], key, "efficiency", source, "a fixed cost per decode step")
    for key in (*PROFILE_FRACTIONS, *PROFILE_OPTIONAL_FRACTIONS):
        if key in values and not 0 < values[key] <= PROFILE_MAX_FRACTION:
            raise SpecError(
                f"{source}: efficiency.{key} = {values[key]:.4g} is not physically plausible: an achieved fraction "
                f"of the GPU type's nominal rate must lie in (0, {PROFILE_MAX_FRACTION}] (exp/PLANNER.md, "
                "'Device profiles'); check the type's nominal tflops / hbm_tbps"
            )
    _check_overhead(
        values["decode_overhead_s"], "decode_overhead_s", "efficiency", source, "a fixed cost per decode step"
    )
    for key in PROFILE_OPTIONAL_OVERHEADS:
        if key in values:
            _check_overhead(values[key], key, "efficiency", source, "a fixed cost per optimizer step")
    if eff.get("tp_unsplit") is not None:
        values["tp_unsplit"] = _profile_number(eff, "tp_unsplit", "efficiency", source)
        if not 0 <= values["tp_unsplit"] <= PROFILE_MAX_TP_UNSPLIT:
            raise SpecError(
                f"{source}: efficiency.tp_unsplit = {values['tp_unsplit']:.4g} is not physically plausible: the "
                f"hidden-sized tensors a TP rank streams whole per token, layer and pass lie in "
                f"[0, {PROFILE_MAX_TP_UNSPLIT:g}] (exp/PLANNER.md, 'Device profiles'); profile again"
            )
    beside = eff.get("decode_beside") or {}
    if not isinstance(beside, dict):
        raise SpecError(f"{source}: efficiency.decode_beside must map neighbour GPU types to numbers, got {beside!r}")
    values["decode_beside"] = {}
    for name in beside:
        factor = _profile_number(beside, name, "efficiency.decode_beside", source)
        lo, hi = PROFILE_DECODE_BESIDE
        if not lo <= factor <= hi:
            raise SpecError(
                f"{source}: efficiency.decode_beside.{name} = {factor:.4g} is not physically plausible: a decode "
                f"step's wall time over the CPU time its decode fit prices, at the type's fraction, lies in [{lo:g}, "
                f"{hi:g}] (exp/PLANNER.md, 'Device profiles'); profile again on a quieter host"
            )
        values["decode_beside"][str(name)] = factor
    try:
        return TypeEfficiency(**values, decode_combine=eff.get("decode_combine", "max"))
    except SpecError as e:  # TypeEfficiency checks the form; say where it came from
        raise SpecError(f"{source}: efficiency.{e}") from None


def check_profile_sync(sync, source: str) -> tuple[float, float]:
    """(link_gbps, sync_latency_s) of a profile's `sync` section, or one SpecError naming the implausible one."""
    if not isinstance(sync, dict) or any(k not in sync for k in ("link_gbps", "sync_latency_s")):
        raise SpecError(f"{source}: 'sync' must be a mapping of link_gbps and sync_latency_s (schedule.py profile)")
    gbps = _profile_number(sync, "link_gbps", "sync", source)
    latency = _profile_number(sync, "sync_latency_s", "sync", source)
    if gbps <= 0:
        raise SpecError(f"{source}: sync.link_gbps = {gbps:.4g} GB/s is not physically plausible (must be > 0)")
    _check_overhead(latency, "sync_latency_s", "sync", source, "the fixed cost of one weight-sync transfer")
    return gbps, latency


@dataclass(frozen=True)
class DeviceProfile:
    """What the planner reads from a device profile: the GPU type it is for, that type's efficiencies, and the
    nominal numbers those fractions are of (the achieved rates are fraction x nominal); optionally the weight-sync
    link its machine achieved (link_gbps: one hop of a bucket between two processes, sync_latency_s: a tiny one)."""

    gpu_type: str
    efficiency: TypeEfficiency
    tflops: float
    hbm_tbps: float
    link_gbps: float | None = None
    sync_latency_s: float | None = None
    # measured under the throttle of an emulated type (`schedule.py profile --gpu-type <emulated type>`): what that
    # type's pieces of work cost this machine after the throttle's pauses, so it applies to that type alone
    emulated: bool = False


def profile_from_dict(d: dict, source: str = "<profile>") -> DeviceProfile:
    """The DeviceProfile of a device profile's structure, checked: one SpecError names what is missing or wrong."""
    if not isinstance(d, dict):
        raise SpecError(f"{source}: a device profile is a mapping (schedule.py profile writes one)")
    for key in ("device", "gpu_type", "efficiency", "nominal"):
        if key not in d:
            raise SpecError(f"{source}: missing '{key}' (schedule.py profile writes it)")
    te = check_profile_efficiency(d["efficiency"], source)
    nominal = d["nominal"] if isinstance(d["nominal"], dict) else {}
    try:
        tflops, tbps = float(nominal["tflops"]), float(nominal["hbm_tbps"])
    except (KeyError, TypeError, ValueError):
        raise SpecError(f"{source}: 'nominal' needs numeric tflops and hbm_tbps (the fractions are of them)") from None
    if not (tflops > 0 and tbps > 0):
        raise SpecError(f"{source}: nominal tflops and hbm_tbps must be > 0")
    gbps = latency = None
    if d.get("sync") is not None:
        gbps, latency = check_profile_sync(d["sync"], source)
    emulated = d.get("emulate") is not None
    if emulated and not isinstance(d["emulate"], dict):
        raise SpecError(f"{source}: 'emulate' must be the mapping of fractions the profile was measured under")
    return DeviceProfile(str(d["gpu_type"]), te, tflops, tbps, gbps, latency, emulated)


def load_profile(path: str | os.PathLike) -> DeviceProfile:
    p = Path(path)
    if not p.exists():
        raise SpecError(f"device profile not found: {path}")
    with open(p) as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise SpecError(f"{path}: not YAML ({e})") from None
    return profile_from_dict(d, str(p))


def apply_profile(eff: Efficiency, cluster: Cluster, prof: DeviceProfile, source: str) -> Efficiency:
    """eff with prof.gpu_type's constants replaced by the profile's. The type must be one of the cluster's, or the
    cluster must emulate device types (emulation.py): those are fractions of the machine that ran the profile, so a
    profile of another type of this machine (exp/profiles/cpu.yaml) applies to each of them (Cluster.speed then
    prices the fractions); a profile of an emulated type itself (`schedule.py profile --gpu-type <it>`, measured
    under its throttle, normalised to the machine) applies to it alone -- give it after the machine's, whose
    training constants it keeps (its own training ran unthrottled: a second reading of the same machine). Where the
    cluster gives a type other nominal numbers than the profile's, the fractions are rescaled so that the achieved rates
    (fraction x nominal) stay the measured ones. A profile with a `sync` section also sets the weight-sync
    constants, which are the cluster's (Efficiency.link_eff, sync_latency_s): link_eff = the measured GB/s over the
    type's intra_gbps, so that the achieved bandwidth of a bucket hop is the measured one."""
    emulated = [name for name, g in cluster.gpu_types.items() if g.emulate is not None]
    if prof.emulated and prof.gpu_type not in emulated:
        raise SpecError(
            f"{source}: a profile measured under the throttle of emulated type '{prof.gpu_type}' applies to that "
            f"type only, and cluster {cluster.name} has no such emulated type (its emulated types: {emulated})"
        )
    targets = [prof.gpu_type] if prof.gpu_type in cluster.gpu_types else sorted(emulated)
    if not targets:
        raise SpecError(
            f"{source}: gpu_type '{prof.gpu_type}' is not a GPU type of cluster {cluster.name} "
            f"{sorted(cluster.gpu_types)}"
        )
    te = prof.efficiency
    out = Efficiency.from_dict(eff.to_dict())
    for name in targets:
        g = cluster.gpu_types[name]
        flops, bw = prof.tflops / g.tflops, prof.hbm_tbps / g.hbm_tbps
        typed = TypeEfficiency(
            mfu_train=te.mfu_train * flops,
            mfu_infer=te.mfu_infer * flops,
            hbm_eff=te.hbm_eff * bw,
            decode_overhead_s=te.decode_overhead_s,
            decode_multirow_s=te.decode_multirow_s,
            train_overhead_s=te.train_overhead_s,
            mfu_decode=None if te.mfu_decode is None else te.mfu_decode * flops,
            decode_combine=te.decode_combine,
            tp_unsplit=te.tp_unsplit,
            tp_overhead_s=te.tp_overhead_s,
            dp_overhead_s=te.dp_overhead_s,
            microbatch_overhead_s=te.microbatch_overhead_s,
            decode_beside=dict(te.decode_beside),
        )
        if prof.emulated and name in eff.per_type:
            # a type profile's training is unthrottled, another reading of this machine's: the machine profile's
            # stays, one measurement for every type, so their training costs keep the ratio of their fractions
            # (a TP step's unsplit work is measured there too, at the decode bandwidth it was fitted with)
            prior = eff.per_type[name]
            typed = replace(
                typed,
                mfu_train=prior.mfu_train,
                train_overhead_s=prior.train_overhead_s,
                tp_unsplit=prior.tp_unsplit * typed.hbm_eff / prior.hbm_eff,
                tp_overhead_s=prior.tp_overhead_s,
                dp_overhead_s=prior.dp_overhead_s,
                microbatch_overhead_s=prior.microbatch_overhead_s,
            )
        out.per_type[name] = typed
    if prof.link_gbps is not None:
        out.link_eff = prof.link_gbps / cluster.gpu_types[targets[0]].intra_gbps
        out.sync_latency_s = prof.sync_latency_s
    return out


def tp_unsplit_fit(
    tp_steps: dict | None,
    train_rate: float,
    optimizer_s: float,
    train_overhead_s: float,
    bw: float,
    microbatch_overhead_s: float = 0.0,
) -> tuple[float, float] | None:
    """(tp_unsplit, tp_overhead_s) from a profile's TP steps (device_profile._profile_train_parallel): what each step took
    beyond what train_step_seconds charges a TP rank without them -- the fitted FLOP rate's FLOPs / tp, the optimizer
    over 1/tp of the parameters, the fixed seconds per optimizer step and per micro-batch, the all-reduces over the
    type's intra link --
    is e = optimizer_steps * tp_overhead_s + tp_unsplit * x, x = (1 - 1/tp) of the step's hidden-sized tensor
    passes at the fitted decode bandwidth `bw` (B/s): least squares over the steps, both terms >= 0 (one step: all
    of it per token). So the cost model gives back the measured steps. None without TP steps."""
    if not tp_steps or not tp_steps.get("points"):
        return None
    tp, layers, hidden = tp_steps["tp"], tp_steps["layers"], tp_steps["hidden"]
    passes, nbytes, opt_steps = tp_steps["passes"], tp_steps["bytes"], tp_steps["optimizer_steps"]
    xs, es = [], []
    for p in tp_steps["points"]:
        tokens = p["tokens"]
        microbatches = opt_steps * math.ceil(tokens / opt_steps / tp_steps["micro_batch_tokens"])
        ring = 2 * (tp - 1) / tp * tokens * hidden * nbytes / (tp_steps["intra_gbps"] * 1e9)
        all_reduce = 2 * passes * layers * (microbatches * LINK_LATENCY_S + ring)
        charged = p["flops"] / (tp * train_rate) + opt_steps * (optimizer_s / tp + train_overhead_s) + all_reduce
        charged += microbatches * microbatch_overhead_s
        xs.append((1 - 1 / tp) * passes * tokens * layers * hidden * nbytes / bw)
        es.append(p["step_s"] - charged)
    unsplit, fixed = (fit_line(xs, es)[:2]) if len(set(xs)) > 1 else (0.0, -1.0)
    if unsplit < 0:  # no growth with the tokens: all of it per optimizer step
        unsplit, fixed = 0.0, max(0.0, sum(es) / len(es))
    elif fixed < 0:  # all of it per token, through the origin
        unsplit, fixed = max(0.0, sum(e * x for e, x in zip(es, xs)) / sum(x * x for x in xs)), 0.0
    return unsplit, fixed / opt_steps


def dp_overhead_fit(dp_steps: dict | None, gpu: GPUType, te: TypeEfficiency) -> float | None:
    """dp_overhead_s from a profile's DP steps (device_profile._profile_train_parallel at dp > 1): the mean over the
    steps of what each took beyond what train_step_seconds charges a DP rank for it with the profile's other
    constants `te` (1/dp of the FLOPs, the optimizer, the fixed seconds per optimizer step, the gradient all-reduce
    over the type's intra link), per optimizer step and >= 0 (DP steps no slower than that: nothing to add). So the
    cost model gives back the measured steps on average. None without DP steps."""
    if not dp_steps or not dp_steps.get("points"):
        return None
    model = model_from_config(dp_steps["model_config"], "profiled")
    dp, opt_steps = int(dp_steps["dp"]), int(dp_steps["optimizer_steps"])
    stage = StageSpec(gpu.name, model.layers, (0,), gpu.intra_gbps, float(dp_steps["intra_gbps"]), 0.0)
    eff = Efficiency(per_type={gpu.name: replace(te, dp_overhead_s=0.0)})
    extra = []
    for p in dp_steps["points"]:
        wl = Workload(
            prompts_per_step=int(p["trajectories"]),
            samples_per_prompt=1,
            prompt_len=float(p["prompt"]),
            gen_samples=[float(p["response"])],
            precision="fp32",
            ppo_minibatches=opt_steps,
            microbatch_tokens=int(dp_steps["micro_batch_tokens"]),
            train_passes=float(dp_steps["passes"]),
        )
        extra.append(p["step_s"] - train_step_seconds(model, [stage], dp, 1, {gpu.name: gpu}, wl, eff))
    return max(0.0, sum(extra) / len(extra)) / opt_steps


def finish_profile(out: dict, gpu: GPUType, log=print, elapsed: float = 0.0) -> dict:
    """Fit the measured points (device_profile.profile_device's structure) and add `measured`, `nominal`, `fractions`,
    `efficiency` (the TypeEfficiency of `gpu` the planner reads) and, when the link was measured, `sync`; then check
    them (check_profile_efficiency, check_profile_sync).
      decode    the points memory-bound by the raw GEMM / copy rates: step = bytes / bandwidth + overhead (hbm_eff,
                decode_overhead_s); the points compute-bound by those rates: step = FLOPs / rate + that overhead
                (mfu_decode; absent without two such points). With those, also step = bytes / bandwidth +
                FLOPs / rate + overhead over every point (relative least squares): where that fits the points better
                -- reads and arithmetic serialised, as on a CPU core -- its constants and decode_combine "sum" are
                the profile's
      prefill   step = FLOPs / rate + c (mfu_infer)
      train     step = FLOPs / rate + c (mfu_train). A point is one Trainer.train_step of `optimizer_steps` optimizer
                steps (its PPO minibatches), so c / optimizer_steps is what one optimizer step costs besides the FLOPs;
                train_overhead_s is that less what train_step_seconds already charges for the optimizer of the
                profiled model (its `params` at OPTIMIZER_BYTES_DP1 bytes each over the decode bandwidth) and less
                one micro-batch's fixed part: the line goes through the points of one micro-batch per minibatch, and
                a point packed into more (`microbatches`) gives microbatch_overhead_s, what each extra one cost
      train_tp  (optional) train points as tensor-parallel steps: tp_unsplit, tp_overhead_s (tp_unsplit_fit)
      train_dp  (optional) train points as data-parallel steps: dp_overhead_s (dp_overhead_fit)
      link      one weight-sync bucket hop between two processes, as a train rank waits for it (fill a buffer,
                checksum it, send; the receiver takes it): hop = bytes / bandwidth (sync.link_gbps); a tiny hop is
                the fixed cost (sync.sync_latency_s)"""
    gemm_rate, copy_rate = out["gemm_tflops"] * 1e12, out["copy_tbps"] * 1e12
    for p in out["decode"]:  # memory-bound by the raw rates: the bandwidth fit uses only those points
        p["memory_bound"] = bool(p["flops"] / gemm_rate < 0.5 * p["bytes"] / copy_rate)
        p["compute_bound"] = bool(p["flops"] / gemm_rate > p["bytes"] / copy_rate)
    use = [p for p in out["decode"] if p["memory_bound"]]
    if len({p["bytes"] for p in use}) < 2:
        use = [p for p in out["decode"] if not p["compute_bound"]] or out["decode"]
    bw, overhead, r2_decode = fit_rate([p["bytes"] for p in use], [p["step_s"] for p in use], "decode")
    compute = [p for p in out["decode"] if p["compute_bound"]]
    decode_rate = None
    if len(compute) >= 2:
        decode_rate = fit_rate_given_overhead(
            [p["flops"] for p in compute], [p["step_s"] for p in compute], overhead, "decode (compute-bound steps)"
        )
    # the two ways a decode step's reads and arithmetic combine (TypeEfficiency.decode_combine), each fitted to every
    # decode point, the points spanning one row to a full batch: the one with the smaller relative error is the device's
    combine, steps, multirow_s = "max", [p["step_s"] for p in out["decode"]], 0.0
    rms = {}
    if decode_rate is not None:
        rms["max"] = relative_rms(
            [overhead + max(p["bytes"] / bw, p["flops"] / decode_rate) for p in out["decode"]], steps
        )

        # the serialised form, with a fixed part a step of more rows costs besides (decode_multirow_s: a core's GEMM
        # path against its one-row matrix-vector path) where the points have both kinds of step and it comes out
        # >= 0; else without it
        def multirow(p: dict) -> float:
            return float(p["batch"] > 1)

        def sum_fit(features):
            try:
                x = fit_relative([[f(p) for f in features] for p in out["decode"]], steps)
            except ValueError:
                return None
            return x if min(x) >= 0 and x[0] > 0 and x[1] > 0 else None

        base = (lambda p: p["bytes"], lambda p: p["flops"], lambda p: 1.0)
        both = len({multirow(p) for p in out["decode"]}) == 2
        fit = (sum_fit((*base, multirow)) if both else None) or sum_fit(base)
        if fit is not None:
            per_byte, per_flop, c, *rest = fit
            extra = rest[0] if rest else 0.0
            rms["sum"] = relative_rms(
                [c + p["bytes"] * per_byte + p["flops"] * per_flop + extra * multirow(p) for p in out["decode"]],
                steps,
            )
            if rms["sum"] < rms["max"]:
                combine, bw, overhead, decode_rate, multirow_s = "sum", 1.0 / per_byte, c, 1.0 / per_flop, extra
    prefill_rate, prefill_c, r2_prefill = fit_rate(
        [p["flops"] for p in out["prefill"]], [p["step_s"] for p in out["prefill"]], "prefill"
    )
    # the line through the steps of one micro-batch per minibatch; the same FLOPs packed finer (`microbatches` > 1)
    # cost each extra micro-batch's fixed part: microbatch_overhead_s
    train = [p for p in out["train"] if p.get("microbatches", 1) == 1]
    split = [p for p in out["train"] if p.get("microbatches", 1) > 1]
    train_rate, train_c, r2_train = fit_rate([p["flops"] for p in train], [p["step_s"] for p in train], "train")
    opt_steps = train[0].get("optimizer_steps", 1)
    # the parameters the cost model's optimizer term charges (a profile before this key: all of them)
    key = "optimizer_params" if "optimizer_params" in train[0] else "params"
    params = train[0].get(key, 0)
    if any(p.get("optimizer_steps", 1) != opt_steps or p.get(key, 0) != params for p in train):
        raise SpecError("profile: the train points must share one model and one number of optimizer steps")
    optimizer_s = params * OPTIMIZER_BYTES_DP1 / bw  # what train_step_seconds charges per optimizer step (dp 1)
    # what one optimizer step costs beyond that. A negative intercept is a noisy fit (refused below); an intercept
    # smaller than the optimizer term means that term already covers the whole fixed cost (a fused optimizer
    # streams fewer bytes than OPTIMIZER_BYTES_DP1): nothing to add
    microbatch_overhead = None
    if split:
        extra = [
            (p["step_s"] - p["flops"] / train_rate - train_c) / (opt_steps * (p["microbatches"] - 1)) for p in split
        ]
        microbatch_overhead = max(0.0, sum(extra) / len(extra))
    # the intercept holds one micro-batch's fixed part per optimizer step; the cost model charges that per micro-batch
    train_overhead = train_c / opt_steps - optimizer_s - (microbatch_overhead or 0.0)
    if train_c >= 0:
        train_overhead = max(0.0, train_overhead)
    tp_fit = tp_unsplit_fit(
        out.get("train_tp"), train_rate, optimizer_s, train_overhead, bw, microbatch_overhead or 0.0
    )
    peak, hbm = gpu.tflops * 1e12, gpu.hbm_tbps * 1e12
    out["measured"] = {
        "gemm_tflops": out["gemm_tflops"],
        "copy_tbps": out["copy_tbps"],
        "decode_tbps": bw / 1e12,
        "decode_overhead_s": overhead,
        "decode_multirow_s": multirow_s,
        "decode_fit_points": len(out["decode"]) if combine == "sum" else len(use),
        "decode_r2": r2_decode,
        **({} if decode_rate is None else {"decode_tflops": decode_rate / 1e12, "decode_compute_points": len(compute)}),
        "decode_combine": combine,
        **{f"decode_rel_rms_{k}": v for k, v in rms.items()},
        "prefill_tflops": prefill_rate / 1e12,
        "prefill_overhead_s": prefill_c,
        "prefill_r2": r2_prefill,
        "train_tflops": train_rate / 1e12,
        "train_overhead_s": train_c,
        "train_r2": r2_train,
        "train_optimizer_steps": opt_steps,
        "train_model_optimizer_s": optimizer_s,
        **({} if tp_fit is None else {"train_tp_unsplit": tp_fit[0], "train_tp_overhead_s": tp_fit[1]}),
    }
    out["nominal"] = {"gpu_type": gpu.name, "tflops": gpu.tflops, "hbm_tbps": gpu.hbm_tbps}
    out["fractions"] = {"gemm": gemm_rate / peak, "copy": copy_rate / hbm}  # of the nominal peaks (diagnostic)
    out["efficiency"] = {
        "mfu_train": train_rate / peak,
        "mfu_infer": prefill_rate / peak,
        "hbm_eff": bw / hbm,
        "decode_overhead_s": overhead,
        **({} if not multirow_s else {"decode_multirow_s": multirow_s}),
        "train_overhead_s": train_overhead,
        **({} if decode_rate is None else {"mfu_decode": decode_rate / peak}),
        **({} if combine == "max" else {"decode_combine": combine}),
        **({} if tp_fit is None else {"tp_unsplit": tp_fit[0], "tp_overhead_s": tp_fit[1]}),
        **({} if microbatch_overhead is None else {"microbatch_overhead_s": microbatch_overhead}),
    }
    if microbatch_overhead is not None:
        out["measured"]["train_microbatch_overhead_s"] = microbatch_overhead
    beside = decode_beside_fit(out.get("decode_beside"), gpu, TypeEfficiency(**out["efficiency"]))
    if beside:
        out["efficiency"]["decode_beside"] = beside
    dp_fit = dp_overhead_fit(out.get("train_dp"), gpu, TypeEfficiency(**out["efficiency"]))
    if dp_fit is not None:
        out["measured"]["train_dp_overhead_s"] = out["efficiency"]["dp_overhead_s"] = dp_fit
    link = out.get("link")
    if link:
        link_rate, link_c, r2_link = fit_rate(
            [p["bytes"] for p in link["points"]], [p["hop_s"] for p in link["points"]], "link"
        )
        out["measured"].update(
            link_gbps=link_rate / 1e9, link_latency_s=link["latency_s"], link_intercept_s=link_c, link_r2=r2_link
        )
        out["sync"] = {"link_gbps": link_rate / 1e9, "sync_latency_s": link["latency_s"]}
    out["seconds"] = elapsed
    m, e = out["measured"], out["efficiency"]
    fits = ", ".join(f"{k} {v:.1%}" for k, v in rms.items())
    if combine == "sum":
        log(
            f"decode:  bytes / {m['decode_tbps'] * 1e3:.2f} GB/s + FLOPs / {decode_rate / 1e9:.2f} GFLOP/s + "
            f"{m['decode_overhead_s'] * 1e3:.3f} ms/step + {multirow_s * 1e3:.3f} ms for more than one row (reads and "
            "arithmetic serialised: least squares over all "
            f"{len(out['decode'])} points; relative rms {fits})"
        )
    else:
        log(
            f"decode:  {m['decode_tbps'] * 1e3:9.2f} GB/s + {m['decode_overhead_s'] * 1e3:.3f} ms/step "
            f"(least squares over {len(use)} memory-bound points, r2 {r2_decode:.3f})"
        )
        if decode_rate is not None:
            log(
                f"decode:  {decode_rate / 1e9:9.2f} GFLOP/s on {len(compute)} compute-bound points (+ the same "
                f"overhead; relative rms {fits})"
            )
    log(f"prefill: {m['prefill_tflops'] * 1e3:9.2f} GFLOP/s + {prefill_c * 1e3:.2f} ms (r2 {r2_prefill:.3f})")
    log(
        f"train:   {m['train_tflops'] * 1e3:9.2f} GFLOP/s + {train_c * 1e3:.2f} ms/step of {opt_steps} optimizer "
        f"step(s) (r2 {r2_train:.3f}): {e['train_overhead_s'] * 1e3:.2f} ms per optimizer step besides the "
        f"{optimizer_s * 1e3:.2f} ms the cost model's optimizer term charges"
    )
    if tp_fit is not None:
        log(
            f"train:   a tp {out['train_tp']['tp']} rank streams {tp_fit[0]:.1f} hidden-sized tensors per token, layer "
            f"and pass that TP does not divide (tp_unsplit) and spends {tp_fit[1] * 1e3:.2f} ms more per optimizer "
            "step (tp_overhead_s)"
        )
    if microbatch_overhead is not None:
        log(
            f"train:   {microbatch_overhead * 1e3:.2f} ms per micro-batch besides its FLOPs (microbatch_overhead_s: the "
            f"step packed into {split[0]['microbatches']} micro-batches per minibatch instead of 1)"
        )
    if beside:
        log(
            "decode:  a replica's step beside each type's trainers, its wall over the fit's CPU price at the fraction "
            "(decode_beside): " + ", ".join(f"{k} {v:.3f}" for k, v in beside.items())
        )
    if dp_fit is not None:
        log(
            f"train:   a dp {out['train_dp']['dp']} rank spends {dp_fit * 1e3:.2f} ms more per optimizer step than "
            "1/dp of the step and the gradient all-reduce (dp_overhead_s)"
        )
    if link:
        log(
            f"link:    {m['link_gbps']:9.3f} GB/s per bucket hop + {m['link_latency_s'] * 1e3:.3f} ms for a tiny one "
            f"(r2 {m['link_r2']:.3f})"
        )
    log(
        f"{gpu.name} ({gpu.tflops:g} TFLOP/s, {gpu.hbm_tbps:g} TB/s nominal): mfu_train {e['mfu_train']:.3f}, "
        f"mfu_infer {e['mfu_infer']:.3f}, hbm_eff {e['hbm_eff']:.3f}, decode_overhead_s {e['decode_overhead_s']:.3g}, "
        f"train_overhead_s {e['train_overhead_s']:.3g}"
        + ("" if decode_rate is None else f", mfu_decode {e['mfu_decode']:.3f}")
        + f" (gemm {out['fractions']['gemm']:.3f}, copy {out['fractions']['copy']:.3f} of nominal)"
    )
    where = f"profile of {out['device']} as {gpu.name}"
    check_profile_efficiency(e, where)
    if "sync" in out:
        check_profile_sync(out["sync"], where)
    return out
