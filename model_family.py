"""The HF model families hexrl runs -- one list, read by the planner's model specs, the trainer and the generator --
and how their weights split over tensor-parallel ranks. Imports no torch (the planner and sync_layout read it).

A family is an HF `model_type` whose decoder is RMSNorm -> attention (GQA, RoPE) -> RMSNorm -> gated MLP, with HF's
parameter names; they differ in q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3) and sliding windows (Mistral).

TP split (the trainer's torch TP plan, the generator's slices and the weight sync all follow it): q/k/v and gate/up
by rows (whole heads, contiguous: a rank's query heads use exactly its own KV heads), o_proj and down_proj by
columns, embedding and LM head by vocabulary rows; norms (Qwen3's per-head q/k norms too) are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from errors import HexrlError


class ModelFamilyError(HexrlError, ValueError):
    """A model hexrl does not run: a family outside MODEL_FAMILIES, or a TP degree its sizes do not split by."""

    same_on_every_rank = True


@dataclass(frozen=True)
class Family:
    qkv_bias: bool  # q/k/v projections carry a bias by default (a config's `attention_bias` overrides)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (`self_attn.q_norm`, `self_attn.k_norm`)


MODEL_FAMILIES: dict[str, Family] = {
    "llama": Family(qkv_bias=False, qk_norm=False),
    "qwen2": Family(qkv_bias=True, qk_norm=False),
    "qwen3": Family(qkv_bias=False, qk_norm=True),
    "mistral": Family(qkv_bias=False, qk_norm=False),
}


def model_family(model_type: str | None) -> Family:
    """The family of an HF `model_type`, or one error naming the list."""
    if model_type not in MODEL_FAMILIES:
        raise ModelFamilyError(f"model_type {model_type!r} is not supported (hexrl runs: {', '.join(MODEL_FAMILIES)})")
    return MODEL_FAMILIES[model_type]


# how each HF parameter is split across TP ranks: 0 = rows (column-parallel / vocab), 1 = columns (row-parallel)
_ROW_SPLIT = (
    "embed_tokens.weight",
    "lm_head.weight",
    "q_proj.weight",
    "q_proj.bias",
    "k_proj.weight",
    "k_proj.bias",
    "v_proj.weight",
    "v_proj.bias",
    "gate_proj.weight",
    "gate_proj.bias",
    "up_proj.weight",
    "up_proj.bias",
)
_COL_SPLIT = ("o_proj.weight", "down_proj.weight")


def shard_dim(name: str) -> int | None:
    """TP split dimension of an HF parameter name (None = replicated on every TP rank)."""
    if name.endswith(_ROW_SPLIT):
        return 0
    if name.endswith(_COL_SPLIT):
        return 1
    return None


def slice_shard(full, dim: int | None, tp_rank: int, tp: int):
    """TP rank `tp_rank`'s slice of an HF tensor split along `dim` (the tensor itself when replicated)."""
    if dim is None or tp == 1:
        return full
    return full.chunk(tp, dim=dim)[tp_rank]


def check_tp_divides(cfg, tp: int) -> None:
    """Head, MLP and vocabulary sharding split whole heads / rows: tp must divide each count. KV heads are never
    replicated across ranks, so a tp above num_key_value_heads is refused too."""
    for what, n in (
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("vocab_size", cfg.vocab_size),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if n % tp:
            raise ModelFamilyError(
                f"tp={tp} must divide {what}={n} (tensor parallelism splits whole heads, MLP rows and vocabulary "
                "rows across ranks; KV heads are not replicated)"
            )
