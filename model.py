"""The HF model's pieces as the generator runs them, each exact against the HF module it replaces.

RoPE with a signed sin, RMSNorm with HF's bits in fewer ops, sliding windows read the way HF reads them, and fused
projections whose storage layout is chosen per shape on CPU (tests/unit/test_generator.py holds the equivalences).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROPE_TABLE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")  # x * rsqrt(mean x^2 + eps) * w


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with rotate_half's sign folded in: rotate_half(x) * sin == roll(x, D/2) * signed_sin, bit for bit."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D] rotated by cos and signed_sin(sin) [B, L, D]."""
    cos, sin_signed = cos.unsqueeze(1), sin_signed.unsqueeze(1)  # [B, 1, L, D] broadcast over heads
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF RMSNorm (fp32 statistics, weight applied in the input dtype) with fewer ops: at decode sizes
    each op is a ~10 us dispatch on CPU and there are 2 norms per layer. For fp32 input `F.rms_norm` is one
    kernel with the same bits (tested); for bf16 HF rounds before the weight, so its arithmetic is written out."""
    if type(norm).__name__ not in RMS_NORM_CLASSES:
        return norm(x)
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    h = x.float()
    inv_rms = h.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()
    return norm.weight * (h * inv_rms).to(x.dtype)


def layer_windows(config, n_layers: int) -> list[int | None]:
    """Sliding-window size per layer (None = full attention), read the way HF reads it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:n_layers]]
    return [window] * n_layers


_INPUT_MAJOR_FASTER: dict[tuple, bool] = {}


def input_major_is_faster(out_features: int, in_features: int, rows: int, dtype: torch.dtype, sweep_bytes: int) -> bool:
    """CPU: is x @ W faster with W stored [in, out] than [out, in] (an nn.Linear's), at decode size?

    MKL's small-GEMM speed depends on the weight's layout, both ways and by shape (gate/up can be faster
    input-major while down_proj is slower). So each shape is timed once per process, both layouts
    interleaved over `sweep_bytes` of weight copies -- the model's own weight bytes, at most 16 MB: a decode step
    reads the weights from memory when the model outgrows the caches and from cache when it does not -- best of 5,
    and input-major must win by 5%. Both layouts give the same bits here (MKL); the tests run both."""
    copies = max(2, min(sweep_bytes, 16 << 20) // (out_features * in_features * dtype.itemsize))
    key = (out_features, in_features, rows, dtype, copies)
    if key not in _INPUT_MAJOR_FASTER:
        x = torch.randn(rows, in_features, dtype=dtype)
        layouts = {"row": [torch.randn(out_features, in_features, dtype=dtype) for _ in range(copies)]}
        layouts["input"] = [w.t().contiguous().t() for w in layouts["row"]]
        best = {}
        for _ in range(5):
            for name, weights in layouts.items():
                t0 = time.perf_counter()
                for w in weights:
                    F.linear(x, w)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        _INPUT_MAJOR_FASTER[key] = best["input"] < 0.95 * best["row"]
    return _INPUT_MAJOR_FASTER[key]


def fuse_linears(
    linears: list[torch.nn.Linear], input_major: Callable[[int, int], bool]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight matrix (and bias) for Linear layers that read the same input: one GEMM instead of several.
    Returned as an [out, in] view like an nn.Linear weight. The layers' parameters become views of it, so
    whatever writes them (update_weights, load_state_dict, another Generator on the same model) writes the
    fused matrix too, and no memory is duplicated. `input_major(out, in)` says whether to store it [in, out]."""

    def cols():
        col = 0
        for lin in linears:
            yield lin, slice(col, col + lin.out_features)
            col += lin.out_features

    fused = getattr(linears[0], "_fused", None)  # a Generator built on this model before
    if fused is not None and all(
        lin.weight.data_ptr() == fused[0][r].data_ptr()
        and lin.weight.stride() == fused[0][r].stride()
        and (lin.bias is None or lin.bias.data_ptr() == fused[1][r].data_ptr())
        for lin, r in cols()
    ):
        return fused
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if input_major(*weight.shape):
        weight = weight.t().contiguous().t()
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat(
            [lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.out_features) for lin in linears]
        )
    for lin, r in cols():
        lin.weight.data = weight[r]
        if lin.bias is not None:
            lin.bias.data = bias[r]
    linears[0]._fused = (weight, bias)
    return weight, bias
