"""Per-sequence causal attention over a packed row, as an HF attention function, for the trainer's HF modules.

A micro-batch is one row of concatenated sequences; position ids restart at 0 for each sequence, and attention is
causal within each sequence only, so the forward is exactly a per-sequence one. HF calls this function from inside
its own attention modules (registered as `ATTENTION`, selected through the config's `_attn_implementation`) and
passes the row's `PackedSeqs` through its keyword arguments. Nothing here builds the T x T block-diagonal mask
(quadratic in the packed length), pads every sequence to the longest, or repeats K/V over GQA groups:
- CPU and GPU without flash-attn: the sequences, sorted by length, are cut into bins whose padding stays under
  PAD_FRACTION of their tokens; each bin is one SDPA call with `enable_gqa` on its right-padded [n, L_bin] batch
  (a valid query never sees a padded key under a causal mask, so padding changes no valid row);
- GPU with flash-attn installed, fp16/bf16: its varlen kernel over the packed row (GQA in the kernel).
A sliding window (Mistral, Qwen layers of type "sliding_attention") masks keys more than `window - 1` positions
back, the way HF reads it; a bin whose sequences all fit in the window takes the plain causal path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

try:  # optional GPU kernel (requirements-gpu.txt); the binned SDPA path is exact without it
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

ATTENTION = "hexrl_packed"  # the name HF modules look the function up by (config._attn_implementation)
PAD_FRACTION = 0.125  # a bin's right-padding stays under this share of its tokens


@dataclass
class PackedSeqs:
    """Where the sequences of one packed row [1, T] lie, and their length bins for attention."""

    seq_lens: list[int]
    max_len: int
    cu_seqlens: torch.Tensor  # int32 [n + 1]: sequence starts, the layout flash-attn's varlen kernel takes
    # per bin: (n, L, the packed position each of its n * L padded slots reads, its valid slots, their positions)
    bins: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]

    @classmethod
    def build(cls, seq_lens: list[int], device) -> PackedSeqs | None:
        """None for a single sequence: attention then takes SDPA's plain causal path."""
        if len(seq_lens) == 1:
            return None
        starts = [0]
        for n in seq_lens[:-1]:
            starts.append(starts[-1] + n)
        bins = []
        for members in length_bins(seq_lens):
            length = max(seq_lens[i] for i in members)
            offset = torch.arange(length)
            lens = torch.tensor([seq_lens[i] for i in members])
            first = torch.tensor([starts[i] for i in members])
            valid = offset[None, :] < lens[:, None]  # [n, L]
            where = torch.where(valid, first[:, None] + offset[None, :], torch.zeros_like(valid, dtype=torch.long))
            where, valid = where.reshape(-1), valid.reshape(-1)
            slots = torch.nonzero(valid).squeeze(1)
            bins.append((len(members), length, where.to(device), slots.to(device), where[slots].to(device)))
        cu = torch.tensor([*starts, sum(seq_lens)], dtype=torch.int32, device=device)
        return cls(list(seq_lens), max(seq_lens), cu, bins)


def length_bins(seq_lens: list[int]) -> list[list[int]]:
    """Sequence indices grouped by length: longest first, a bin closes when padding its next member would push the
    bin's padded slots over its real tokens by more than PAD_FRACTION."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    bins: list[list[int]] = []
    real = 0
    for i in order:
        if bins:
            longest = seq_lens[bins[-1][0]]
            if longest * (len(bins[-1]) + 1) <= (1 + PAD_FRACTION) * (real + seq_lens[i]):
                bins[-1].append(i)
                real += seq_lens[i]
                continue
        bins.append([i])
        real = seq_lens[i]
    return bins


def packed_position_ids(seq_lens: list[int], device) -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])[None]


def _causal(q, k, v, scaling: float, window: int | None) -> torch.Tensor:
    """SDPA over [n, heads, L, D] batches, causal (within `window` when it bites), GQA in the kernel."""
    length = q.shape[2]
    if window is None or window >= length:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    pos = torch.arange(length, device=q.device)
    back = pos[:, None] - pos[None, :]
    mask = (back >= 0) & (back < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)


def _padded(x: torch.Tensor, where: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """[1, h, T, D] -> the bin's [n, h, L, D] (padded slots read position 0; causality keeps them unread)"""
    return x[0].index_select(1, where).view(x.shape[1], n, length, x.shape[3]).transpose(0, 1)


def _flash_varlen_dtype(q: torch.Tensor) -> torch.dtype | None:
    """the half dtype to run flash-attn's varlen kernel in, or None to use the binned SDPA path"""
    if flash_attn_varlen_func is None or not q.is_cuda:
        return None
    if q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed: PackedSeqs | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: q [1, heads, T, D], k/v [1, kv_heads, T, D] (after RoPE) -> [1, T, heads,
    D]. `attention_mask` is unused: packing and causality come from `packed`."""
    window = sliding_window or None
    if packed is None:
        return _causal(query, key, value, scaling, window).transpose(1, 2), None
    flash_dtype = _flash_varlen_dtype(query) if window is None else None
    if flash_dtype is not None:
        q, k, v = (z[0].transpose(0, 1).to(flash_dtype) for z in (query, key, value))  # [T, heads, D]
        out = flash_attn_varlen_func(
            q, k, v, packed.cu_seqlens, packed.cu_seqlens, packed.max_len, packed.max_len, causal=True,
            softmax_scale=scaling,
        )  # fmt: skip
        return out[None].to(query.dtype), None
    heads, out = query.shape[1], None
    for n, length, where, slots, positions in packed.bins:
        q, k, v = (_padded(x, where, n, length) for x in (query, key, value))
        y = _causal(q, k, v, scaling, window)  # [n, heads, L, D]
        y = y.transpose(0, 1).reshape(heads, n * length, -1)
        if out is None:  # in the kernel's dtype (autocast may lower it)
            out = y.new_empty(heads, query.shape[2], y.shape[-1])
        out.index_copy_(1, positions, y.index_select(1, slots))
    return out.transpose(0, 1)[None], None


AttentionInterface.register(ATTENTION, packed_attention)
