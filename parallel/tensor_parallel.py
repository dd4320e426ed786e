"""Tensor-parallel Llama/Qwen2-family decoder stage, built by slicing an HF model's weights.

One `DecoderStage` holds the layers [start, end) of one pipeline stage and this rank's TP shard of them:
- attention is head-sharded: q/k/v are column-parallel (GQA: q heads and kv heads both split contiguously, so
  each rank's q heads use exactly its own kv heads), o_proj is row-parallel;
- MLP gate/up are column-parallel, down is row-parallel;
- embedding and LM head are vocab-parallel (rows [vocab_start, vocab_start + V/tp)); the last stage returns
  *local* logits, to be fed to `vocab_parallel_logprobs_and_entropy`.
Parameters are named exactly like the HF model ("model.layers.3.mlp.up_proj.weight"), and `shard_specs` says how
each is sliced from the HF tensor (dim 0, dim 1, or replicated), which is all gather/slicing code needs.

Packed sequences: a micro-batch is one row of concatenated sequences; position ids restart at 0 for each
sequence and attention is causal within each sequence only, so it is exactly a per-sequence forward. Attention
never builds the T x T block-diagonal mask (quadratic in the packed length): q/k/v are gathered into a right-padded [n_seqs, L_max] batch for SDPA's plain causal path (a valid
query never sees a padded key under a causal mask), or handed to flash-attn's varlen kernel on GPU when installed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model_family import check_tp_divides, model_family, shard_dim, slice_shard

try:  # optional GPU kernel (requirements-gpu.txt); the padded SDPA path below is exact without it
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

# ----------------------------------------------------------------------------------------------------------------
# the two TP communication primitives (Megatron's f and g)


class _CopyToTP(torch.autograd.Function):
    """identity forward, all-reduce of the gradient backward (input of a column-parallel layer)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """all-reduce forward, identity backward (output of a row-parallel layer)"""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPContext:
    def __init__(self, tp_rank: int = 0, tp: int = 1, group=None):
        self.tp_rank, self.tp, self.group = tp_rank, tp, group

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else _CopyToTP.apply(x, self.group)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else _ReduceFromTP.apply(x, self.group)


# ----------------------------------------------------------------------------------------------------------------
# modules (parameter-holding shells; communication is explicit in the forwards)


class ShardLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class VocabEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab_start: int):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start = vocab_start

    def forward(self, ids: torch.Tensor, tp: TPContext) -> torch.Tensor:
        if tp.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return tp.reduce(out * inside.unsqueeze(-1).to(out.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, hf_attn: nn.Module, local_heads: int, local_kv_heads: int, shards: dict):
        super().__init__()
        self.q_proj = ShardLinear(shards["q_proj.weight"], shards.get("q_proj.bias"))
        self.k_proj = ShardLinear(shards["k_proj.weight"], shards.get("k_proj.bias"))
        self.v_proj = ShardLinear(shards["v_proj.weight"], shards.get("v_proj.bias"))
        self.o_proj = ShardLinear(shards["o_proj.weight"], shards.get("o_proj.bias"))
        self.heads, self.kv_heads = local_heads, local_kv_heads
        self.head_dim = hf_attn.head_dim
        self.scaling = hf_attn.scaling

    def forward(self, x, cos, sin, packed: PackedSeqs | None, tp: TPContext):
        b, t, _ = x.shape
        x = tp.copy(x)
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        flash_dtype = _flash_varlen_dtype(q) if packed is not None else None
        if flash_dtype is not None:
            q, k, v = (z[0].transpose(0, 1).to(flash_dtype) for z in (q, k, v))  # [T, heads, D]
            y = flash_attn_varlen_func(
                q,
                k,
                v,
                packed.cu_seqlens,
                packed.cu_seqlens,
                packed.max_len,
                packed.max_len,
                causal=True,
                softmax_scale=self.scaling,
            )  # GQA handled by the kernel
            y = y.reshape(b, t, self.heads * self.head_dim)
        else:
            if self.kv_heads != self.heads:
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            if packed is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
            else:
                y = packed.unpad(
                    F.scaled_dot_product_attention(
                        packed.pad(q), packed.pad(k), packed.pad(v), is_causal=True, scale=self.scaling
                    )
                )
            y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        # row-parallel: partial products summed over TP, then the (replicated) bias once
        out = tp.reduce(F.linear(y, self.o_proj.weight))
        return out if self.o_proj.bias is None else out + self.o_proj.bias


class MLP(nn.Module):
    def __init__(self, act_fn: nn.Module, shards: dict):
        super().__init__()
        self.gate_proj = ShardLinear(shards["gate_proj.weight"], shards.get("gate_proj.bias"))
        self.up_proj = ShardLinear(shards["up_proj.weight"], shards.get("up_proj.bias"))
        self.down_proj = ShardLinear(shards["down_proj.weight"], shards.get("down_proj.bias"))
        self.act_fn = act_fn

    def forward(self, x, tp: TPContext):
        x = tp.copy(x)
        out = tp.reduce(F.linear(self.act_fn(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight))
        return out if self.down_proj.bias is None else out + self.down_proj.bias


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer: nn.Module, eps: float, local_heads: int, local_kv_heads: int, shards: dict):
        super().__init__()

        def sub(prefix: str) -> dict:
            return {k[len(prefix) :]: v for k, v in shards.items() if k.startswith(prefix)}

        self.input_layernorm = RMSNorm(shards["input_layernorm.weight"], eps)
        self.self_attn = Attention(hf_layer.self_attn, local_heads, local_kv_heads, sub("self_attn."))
        self.post_attention_layernorm = RMSNorm(shards["post_attention_layernorm.weight"], eps)
        self.mlp = MLP(hf_layer.mlp.act_fn, sub("mlp."))

    def forward(self, h, cos, sin, packed: PackedSeqs | None, tp: TPContext):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, packed, tp)
        return h + self.mlp(self.post_attention_layernorm(h), tp)


class _Body(nn.Module):
    """mirrors HF's `model.` prefix so parameter names match the HF checkpoint"""


class DecoderStage(nn.Module):
    """Layers [start, end) of an HF causal LM, TP shard `tp_rank` of `tp`. First stage: ids -> hidden; middle:
    hidden -> hidden; last stage: hidden -> local logits [B, T, V/tp] (the whole model when first and last)."""

    def __init__(
        self,
        hf_model: nn.Module,
        layers: tuple[int, int],
        first: bool,
        last: bool,
        tp_rank: int = 0,
        tp: int = 1,
        tp_group=None,
    ):
        super().__init__()
        cfg = hf_model.config
        check_model_supports_tp(cfg, tp)
        start, end = layers
        if not (0 <= start < end <= cfg.num_hidden_layers):
            raise ValueError(f"stage layers [{start},{end}) outside the model's {cfg.num_hidden_layers} layers")
        self.config, self.layer_range, self.first, self.last = cfg, (start, end), first, last
        # per-layer activation checkpointing (torch.utils.checkpoint): a layer keeps only its input and recomputes
        # the rest in backward -- its TP collectives too, in the same order on every TP rank, so they pair up
        self.activation_checkpointing = False
        self.tp = TPContext(tp_rank, tp, tp_group)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.vocab_start = tp_rank * (cfg.vocab_size // tp)
        self.shard_specs: dict[str, int | None] = {}
        full = dict(hf_model.named_parameters(remove_duplicate=False))

        def take(name: str) -> torch.Tensor:
            dim = shard_dim(name)
            self.shard_specs[name] = dim
            return slice_shard(full[name].detach(), dim, tp_rank, tp).clone().float()

        self.model = _Body()
        # the rotary module is reused as-is (no parameters): it knows the model's RoPE scaling variant
        # (a copy, so moving this stage to a device leaves the caller's HF module where it was)
        self.rotary_emb = copy.deepcopy(hf_model.model.rotary_emb)
        if first:
            self.model.embed_tokens = VocabEmbedding(take("model.embed_tokens.weight"), self.vocab_start)
        heads, kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        self.model.layers = nn.ModuleDict()
        for i in range(start, end):
            prefix = f"model.layers.{i}."
            shards = {n[len(prefix) :]: take(n) for n in full if n.startswith(prefix)}
            self.model.layers[str(i)] = DecoderLayer(
                hf_model.model.layers[i], cfg.rms_norm_eps, heads, kv_heads, shards
            )
        if last:
            self.model.norm = RMSNorm(take("model.norm.weight"), cfg.rms_norm_eps)
            if self.tied and first:
                self.lm_head_weight_name = "model.embed_tokens.weight"
            else:
                # untied, or tied across stages: the last stage holds its own copy of the embedding shard, and
                # the trainer sums its gradient with stage 0's so both copies take identical steps
                source = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
                self.lm_head = ShardLinear(take(source), None)
                if self.tied:
                    self.shard_specs.pop(source)
                self.shard_specs["lm_head.weight"] = 0
                self.lm_head_weight_name = "lm_head.weight"

    def lm_head_weight(self) -> torch.Tensor:
        return (
            self.model.embed_tokens.weight
            if self.lm_head_weight_name == "model.embed_tokens.weight"
            else self.lm_head.weight
        )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, packed: PackedSeqs | None) -> torch.Tensor:
        """x: token ids [B, T] on the first stage, hidden [B, T, H] elsewhere; packed: the sequences packed in
        the single row (B = 1), or None for plain causal attention over each row."""
        h = self.model.embed_tokens(x, self.tp) if self.first else x
        cos, sin = self.rotary_emb(h, position_ids)
        for layer in self.model.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, packed, self.tp, use_reentrant=False)
            else:
                h = layer(h, cos, sin, packed, self.tp)
        if not self.last:
            return h
        h = self.tp.copy(self.model.norm(h))
        return F.linear(h, self.lm_head_weight())

    def replicated_over_tp(self, name: str) -> bool:
        return self.shard_specs.get(name) is None


def check_model_supports_tp(cfg, tp: int) -> None:
    """What the parallel trainer runs: its model types, no sliding window, and the TP divisibility."""
    if model_family(getattr(cfg, "model_type", None)).qk_norm:
        raise ValueError("Qwen3's q/k norms are not supported by the parallel trainer yet")
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and cfg.sliding_window):
        raise ValueError("sliding-window attention is not supported by the parallel trainer")
    check_tp_divides(cfg, tp)


@dataclass
class PackedSeqs:
    """Where the sequences of one packed row [1, T] lie, for per-sequence causal attention."""

    seq_lens: list[int]
    max_len: int
    to_padded: torch.Tensor  # [n * max_len]: packed position of each right-padded slot (0 for padding)
    to_packed: torch.Tensor  # [T]: padded slot of each packed position
    cu_seqlens: torch.Tensor  # int32 [n + 1]: sequence starts, the layout flash-attn's varlen kernel takes

    @classmethod
    def build(cls, seq_lens: list[int], device) -> PackedSeqs | None:
        """None for a single sequence: attention then takes SDPA's plain causal path."""
        if len(seq_lens) == 1:
            return None
        max_len = max(seq_lens)
        lens = torch.tensor(seq_lens, device=device)
        starts = torch.cumsum(lens, 0) - lens
        offset = torch.arange(max_len, device=device)
        inside = offset[None, :] < lens[:, None]  # [n, max_len]
        to_padded = torch.where(inside, starts[:, None] + offset[None, :], torch.zeros_like(inside, dtype=torch.long))
        to_packed = torch.nonzero(inside.reshape(-1)).squeeze(1)  # row-major = packed order
        cu = torch.cat([starts, lens.sum()[None]]).to(torch.int32)
        return cls(list(seq_lens), max_len, to_padded.reshape(-1), to_packed, cu)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, T, D] -> [n, H, max_len, D]"""
        h, d = x.shape[1], x.shape[3]
        return x[0].index_select(1, self.to_padded).view(h, len(self.seq_lens), self.max_len, d).transpose(0, 1)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[n, H, max_len, D] -> [1, H, T, D] (padded query rows dropped)"""
        h, d = y.shape[1], y.shape[3]
        return y.transpose(0, 1).reshape(h, -1, d).index_select(1, self.to_packed)[None]


def _flash_varlen_dtype(q: torch.Tensor) -> torch.dtype | None:
    """the half dtype to run flash-attn's varlen kernel in, or None to use the padded SDPA path"""
    if flash_attn_varlen_func is None or not q.is_cuda:
        return None
    if q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def packed_position_ids(seq_lens: list[int], device) -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])[None]
