"""The weight-sync layout: which HF tensors travel in which bucket, who sends them, and over which links.

The runtime sends exactly these buckets (parallel/weight_sync.py, parallel/trainer.py) and the planner prices the
very same list (planner/cost.py), so both import this module; it imports no torch and nothing of the planner.
  hf_shape / hf_param_table   the HF state dict of a model family (model_family.py) as (name, numel) in state-dict order
  param_stage                 the pipeline stage that owns a tensor
  sync_buckets / SyncBucket   the buckets of one version, per stage in order, each sealed by an int64 checksum
  assign_senders              which DP replica's owner of a stage sends it to each rollout machine
  Links / links_from_cluster  GB/s between machines, read from a cluster dict (a plan's inputs.cluster)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from model_family import MODEL_FAMILIES, model_family

SYNC_CHECKSUM_BYTES = 8  # each bucket carries its int64 checksum after its payload (padded to 8 bytes)


@dataclass(frozen=True)
class SyncBucket:
    """One weight-sync bucket: consecutive HF tensors of one pipeline stage, in one dtype."""

    stage: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    itemsize: int

    @property
    def payload_bytes(self) -> int:
        return sum(self.numels) * self.itemsize

    @property
    def wire_bytes(self) -> int:
        """What one send of this bucket moves: the payload padded to 8 bytes, then its checksum."""
        return -(-self.payload_bytes // 8) * 8 + SYNC_CHECKSUM_BYTES


@dataclass(frozen=True)
class HFShape:
    """The sizes of an HF decoder that fix its state dict (the planner's ModelSpec carries the same fields)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: per-head RMSNorm weights of q and k


def hf_shape(cfg: dict) -> HFShape:
    """An HF config.json (dict) read as its sizes: KV heads default to the heads, head_dim to hidden / heads, and
    q/k/v carry a bias where `attention_bias` says so or, without it, where the family has one (model_family.py; a
    config without model_type reads as Llama). Raises KeyError, TypeError or ValueError on a missing or malformed
    field, ModelFamilyError (a ValueError) on a family hexrl does not run."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    family = model_family(cfg["model_type"]) if "model_type" in cfg else MODEL_FAMILIES["llama"]
    return HFShape(
        layers=int(cfg["num_hidden_layers"]),
        hidden=hidden,
        intermediate=int(cfg["intermediate_size"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", family.qkv_bias)),
        qk_norm=family.qk_norm,
    )


def hf_param_table(model: HFShape) -> list[tuple[str, int]]:
    """The HF state dict of a model family as weight sync sends it: (name, numel) in state-dict order; a tied
    model sends no lm_head (the receiver's lm_head is its embedding). `model`: an HFShape or anything with its
    fields (the planner's ModelSpec)."""
    q, kv, h = model.heads * model.head_dim, model.kv_heads * model.head_dim, model.hidden
    out = [("model.embed_tokens.weight", model.vocab * h)]
    for i in range(model.layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((f"{p}self_attn.{proj}.weight", rows * h))
            if model.qkv_bias:
                out.append((f"{p}self_attn.{proj}.bias", rows))
        out.append((f"{p}self_attn.o_proj.weight", h * q))
        if getattr(model, "qk_norm", False):
            out += [(f"{p}self_attn.q_norm.weight", model.head_dim), (f"{p}self_attn.k_norm.weight", model.head_dim)]
        out += [(f"{p}mlp.{m}_proj.weight", h * model.intermediate) for m in ("gate", "up", "down")]
        out += [(f"{p}input_layernorm.weight", h), (f"{p}post_attention_layernorm.weight", h)]
    out.append(("model.norm.weight", h))
    if not model.tied:
        out.append(("lm_head.weight", model.vocab * h))
    return out


def param_stage(name: str, stage_layers: list[tuple[int, int]]) -> int:
    """The pipeline stage that owns an HF tensor: embeddings on the first, the final norm and head on the last."""
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(s for s, (a, b) in enumerate(stage_layers) if a <= layer < b)
    return len(stage_layers) - 1


def sync_buckets(
    params: list[tuple[str, int]], stage_layers: list[tuple[int, int]], itemsize: int, bucket_bytes: int
) -> list[SyncBucket]:
    """THE weight-sync schedule, for the runtime (which sends exactly these buckets) and the planner (which prices
    them): per stage in order, consecutive tensors packed while the payload stays within `bucket_bytes`; a tensor
    larger than that travels alone."""
    by_stage: dict[int, list[tuple[str, int]]] = {}
    for name, numel in params:
        by_stage.setdefault(param_stage(name, stage_layers), []).append((name, numel))
    out = []
    for stage in sorted(by_stage):
        names: list[str] = []
        numels: list[int] = []
        for name, numel in by_stage[stage]:
            if names and (sum(numels) + numel) * itemsize > bucket_bytes:
                out.append(SyncBucket(stage, tuple(names), tuple(numels), itemsize))
                names, numels = [], []
            names.append(name)
            numels.append(numel)
        if names:
            out.append(SyncBucket(stage, tuple(names), tuple(numels), itemsize))
    return out


def sync_bytes_sent(buckets: list[SyncBucket], rollout_machines: int) -> int:
    """Bytes the train ranks send per version: each bucket once to one receiver (relay) per rollout machine."""
    return rollout_machines * sum(b.wire_bytes for b in buckets)


def assign_senders(owner_machines: list[list[int]], rollout_machines: list[int], gbps) -> dict[tuple[int, int], int]:
    """(stage, rollout machine) -> the DP replica whose owner of that stage sends it its buckets. Every DP replica
    holds the same weights, so each rollout machine takes each stage from its best-connected replica, ties going to
    the least-loaded one: the fan-out spreads over the DP replicas. `owner_machines[stage][dp]` is where that
    owner runs; `gbps(a, b)` the bandwidth between machines a and b. The runtime and the planner both call this."""
    load: dict[tuple[int, int], int] = {}
    out: dict[tuple[int, int], int] = {}
    for m in sorted(rollout_machines):
        for stage, machines in enumerate(owner_machines):
            dp = max(range(len(machines)), key=lambda d: (gbps(machines[d], m), -load.get((stage, d), 0), -d))
            out[(stage, m)] = dp
            load[(stage, dp)] = load.get((stage, dp), 0) + 1
    return out


@dataclass(frozen=True)
class Links:
    """The bandwidth between machines of a cluster: one GPU on machine a to one on machine b."""

    machine_types: tuple[str, ...]  # machine index -> its GPU type
    intra_gbps: Mapping[str, float]  # GPU type -> GPU<->GPU inside one machine (NVLink, one direction)
    inter_gbps: Mapping[tuple[str, str], float]  # sorted GPU type pair -> between two machines
    machine_gbps: Mapping[tuple[int, int], float]  # (low, high) machine pair -> its own link, overriding the types'

    def gbps(self, a: int, b: int) -> float:
        """GB/s between one GPU on machine a and one on machine b (a == b: inside the machine)."""
        ta, tb = self.machine_types[a], self.machine_types[b]
        if a == b:
            return self.intra_gbps[ta]
        key = (min(a, b), max(a, b))
        if key in self.machine_gbps:
            return self.machine_gbps[key]
        return self.inter_gbps[(ta, tb) if ta <= tb else (tb, ta)]


def links_from_cluster(spec: dict) -> Links:
    """The links of a cluster dict in the exp/clusters/*.yaml shape, as a plan's inputs.cluster carries it
    (machines expanded by `count`). The planner validates the spec when it reads it (planner/specs.py)."""
    types = [str(m["gpu_type"]) for m in spec["machines"] for _ in range(int(m.get("count", 1)))]
    links = spec.get("links") or {}
    inter = {}
    for key, v in (links.get("inter_gbps") or {}).items():
        a, _, b = str(key).partition("-")
        inter[tuple(sorted((a, b)))] = float(v)
    overrides = {(min(a, b), max(a, b)): float(v) for a, b, v in links.get("machine_gbps") or []}
    intra = {name: float(g["intra_gbps"]) for name, g in spec["gpu_types"].items()}
    return Links(tuple(types), intra, inter, overrides)
