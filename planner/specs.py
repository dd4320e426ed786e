"""The planner's inputs: the cluster, the model, the workload and the achieved fractions of peak.

  cluster spec  -> GPUType / Machine / Cluster     (exp/clusters/*.yaml)
  model spec    -> ModelSpec                       (an HF config.json of a family in model_family.py)
  workload      -> Workload                        (batch, lengths, eta, precision)
  efficiencies  -> Efficiency                      (achieved fraction of peak: calibrated, or a device profile)
Units: seconds, bytes, FLOPs, tokens. GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import yaml

from cpu_bench import host
from cpu_bench.host import HostSpeeds
from errors import HexrlError
from parallel.sync_layout import Links, hf_shape

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "exp" / "models"


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


@dataclass(frozen=True)
class Machine:
    index: int
    gpu_type: str
    gpus: int


@dataclass(frozen=True)
class NominalSpeeds:
    """Every device at its own rates, as GPUs run: a Cluster's device speeds unless a CPU host stands in for it
    (cpu_bench/host.HostSpeeds, which answers the same questions). The planner asks: the fraction of its rates a
    device of a machine runs at for one kind of work in one role (speed; of a GPU type: type_speed; a replica's
    decode: decode_speed), and the Evaluation of a split once its speeds settle (settle)."""

    @property
    def emulated(self) -> dict:  # GPU type -> its emulated fractions (cpu_bench/emulation.py): none
        return {}

    def speed(self, machine: int, kind: str = "compute", role: str | None = None) -> float:
        return 1.0

    def type_speed(self, type_name: str, kind: str = "compute", role: str | None = None) -> float:
        return 1.0

    def decode_speed(self, type_name: str) -> float:
        return 1.0

    def settle(self, planner, train_counts: tuple[int, ...], exhaustive: bool):
        return planner.price(train_counts, exhaustive)

    def unpriced(self) -> NominalSpeeds:
        return self

    def subset(self, kept: list[tuple[int, int]]) -> NominalSpeeds:
        return self

    def cluster_dict(self, d: dict) -> dict:
        return d


@dataclass
class Cluster:
    name: str
    gpu_types: dict[str, GPUType]
    machines: list[Machine]
    inter_gbps: dict[tuple[str, str], float]  # unordered type pair -> GB/s
    machine_gbps: dict[tuple[int, int], float] = field(default_factory=dict)  # machine pair override
    # the fraction of its own rates each device runs at: its own on GPUs; the CPU bench's pricing of its host where
    # the cluster YAML declares one (cpu_bench/host.HostSpeeds)
    speeds: NominalSpeeds | HostSpeeds = field(default_factory=NominalSpeeds)

    @property
    def n_gpus(self) -> int:
        return sum(m.gpus for m in self.machines)

    def gpu(self, type_name: str) -> GPUType:
        return self.gpu_types[type_name]

    def with_speeds(self, speeds: NominalSpeeds | HostSpeeds) -> Cluster:
        """The same GPUs and links, their devices priced at `speeds`."""
        return replace(self, speeds=speeds)

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
        return Cluster(
            self.name, dict(self.gpu_types), list(self.machines), dict(self.inter_gbps), {}, self.speeds.unpriced()
        )

    def dollars_per_hour(self) -> float:
        return sum(m.gpus * self.gpu_types[m.gpu_type].dollars_per_hour for m in self.machines)

    def subset(self, machine_counts: dict[int, int]) -> Cluster:
        """The sub-cluster keeping machine_counts[i] GPUs of machine i (0 drops it); machines renumbered."""
        keep = [
            (m, machine_counts.get(m.index, m.gpus)) for m in self.machines if machine_counts.get(m.index, m.gpus) > 0
        ]
        new_index = {m.index: i for i, (m, _) in enumerate(keep)}
        machines = [Machine(i, m.gpu_type, n) for i, (m, n) in enumerate(keep)]
        overrides = {
            (new_index[a], new_index[b]): v
            for (a, b), v in self.machine_gbps.items()
            if a in new_index and b in new_index
        }
        kept = [(m.index, n) for m, n in keep]
        return Cluster(
            self.name, dict(self.gpu_types), machines, dict(self.inter_gbps), overrides, self.speeds.subset(kept)
        )

    def to_dict(self) -> dict:
        return self.speeds.cluster_dict(
            {
                "name": self.name,
                "gpu_types": {
                    k: {f: v for f, v in asdict(g).items() if f != "name"} for k, g in self.gpu_types.items()
                },
                "machines": [{"gpu_type": m.gpu_type, "gpus": m.gpus} for m in self.machines],
                "links": {
                    "inter_gbps": {f"{a}-{b}": v for (a, b), v in self.inter_gbps.items()},
                    "machine_gbps": [[a, b, v] for (a, b), v in self.machine_gbps.items()],
                },
            }
        )


def cluster_from_dict(spec: dict, source: str = "<dict>", nproc: int | None = None) -> Cluster:
    """Parse the YAML structure documented in exp/clusters/*.yaml; nproc resizes a one-machine cluster."""

    def need(d: dict, key: str, where: str):
        if not isinstance(d, dict) or key not in d:
            raise SpecError(f"{source}: missing '{key}' in {where}")
        return d[key]

    types, emulated = {}, {}
    for name, g in need(spec, "gpu_types", "cluster").items():
        try:
            types[name] = GPUType(
                name,
                float(g["hbm_gb"]),
                float(g["tflops"]),
                float(g["hbm_tbps"]),
                float(g["dollars_per_hour"]),
                float(g["intra_gbps"]),
            )
            emulation = host.parse_emulate(g, f"{source}: gpu_types.{name}")
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError(
                f"{source}: gpu_types.{name} needs numeric hbm_gb, tflops, hbm_tbps, "
                f"dollars_per_hour, intra_gbps ({e!r})"
            ) from None
        if min(types[name].hbm_gb, types[name].tflops, types[name].hbm_tbps, types[name].intra_gbps) <= 0:
            raise SpecError(f"{source}: gpu_types.{name} has a non-positive capacity")
        if emulation is not None:
            emulated[name] = emulation
    machines: list[Machine] = []
    cores: list[float | None] = []  # per machine: the host cores its devices share (the CPU bench)
    for i_entry, entry in enumerate(need(spec, "machines", "cluster")):
        t = need(entry, "gpu_type", "a machines entry")
        if t not in types:
            raise SpecError(f"{source}: machine gpu_type '{t}' is not in gpu_types {sorted(types)}")
        gpus, count = int(need(entry, "gpus", "a machines entry")), int(entry.get("count", 1))
        if gpus <= 0 or count <= 0:
            raise SpecError(f"{source}: machine of {t} needs gpus >= 1 and count >= 1")
        shared = entry.get("host_cores")
        if shared is not None:
            try:
                shared = host.parse_host_cores(shared, f"{source}: machines[{i_entry}]")
            except host.HostSpecError as e:
                raise SpecError(str(e)) from None
        cores += [shared] * count
        machines += [Machine(len(machines) + i, t, gpus) for i in range(count)]
    if not machines:
        raise SpecError(f"{source}: no machines")
    if nproc is not None:
        if len(machines) != 1:
            raise SpecError(
                f"{source}: --gpus/--nproc only resizes a one-machine cluster (this one has {len(machines)})"
            )
        if nproc < 2:
            raise SpecError(f"--gpus/--nproc must be >= 2 (one rollout and one train rank), got {nproc}")
        machines, cores = [Machine(0, machines[0].gpu_type, nproc)], cores[:1]
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
    speeds = NominalSpeeds()
    if emulated or any(c is not None for c in cores):  # a CPU host stands in for the cluster
        speeds = host.HostSpeeds(
            tuple(m.gpu_type for m in machines), tuple(m.gpus for m in machines), tuple(cores), emulated
        )
    return Cluster(str(spec.get("name", Path(source).stem)), types, machines, inter, overrides, speeds)


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
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm weights

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + norms + bias

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
            "model_type": "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama",
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
