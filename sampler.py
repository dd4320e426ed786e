"""The sampler: one token per row from fp32 logits, reproducible per request, and the log-prob convention.

Log-prob convention (the trainer uses the same): logprob = log_softmax(logits / temperature) over the full
vocabulary in fp32, i.e. after temperature and BEFORE top-k/top-p truncation; for greedy (temperature 0) it is
log_softmax(logits), i.e. temperature 1.

Seeds: sampling noise is counter based, u = hash(seed, index of the token in the completion), and a token is drawn
by inverting the CDF of the (truncated) distribution at u, so a request with a given seed samples the same tokens
whichever requests share its batch and whichever slot it lands in. We keep our own sampler for that reason:
torch.multinomial and the exponential-race trick draw per batch, not per request.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer avalanche hash of a Python int or int64 lanes (multipliers < 2**31: no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def seed_hash(seed):
    """The seed's half of counter_uniform, computed once per request (int, or int64 tensor)."""
    return _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))


def uniform_from_hash(hashed_seed, counter):
    h = _mix32(hashed_seed ^ (counter & _MASK32))
    return (h.to(torch.float64) + 0.5) / 2.0**32 if isinstance(h, torch.Tensor) else (h + 0.5) / 2.0**32


def counter_uniform(seeds, counters):
    """u in (0, 1) as a pure function of (seed, counter): the same draw in any batch, on any slot.
    Python ints or int64 tensors, the same value either way (the sampler hashes a batch's few ints in
    Python: ~30 tensor ops of 32 lanes cost more than the arithmetic)."""
    return uniform_from_hash(seed_hash(seeds), counters)


@torch.library.custom_op("hexrl::cumsum_last_dim", mutates_args=())
def cumsum_last_dim(x: torch.Tensor) -> torch.Tensor:
    """ATen's cumsum over the last dim, opaque to torch.compile. Inductor would lower the sampler's CDF over a
    large vocabulary (151,936 rows for Qwen2) into a split-scan kernel, and torch 2.11 fuses the greedy argmax into
    that kernel, which it cannot generate ("NYI TritonSplitDimKernel reductions"). As an opaque op the compiled
    step calls the kernel eager calls: the same CDF, bit for bit, compiled or not, and capturable in a CUDA graph."""
    return torch.cumsum(x, dim=-1)


@cumsum_last_dim.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    u: torch.Tensor,
    truncate: bool,
    greedy_rows: tuple[bool, bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (tokens, logprobs); rows with temperature 0 are greedy.

    logits [B, V] fp32; temperature [B] fp32, or one float for all rows; top_p [B] fp32 and top_k [B]
    int64 (V when disabled), needed only with `truncate`; u [B] fp64. Sampling inverts the CDF, in vocabulary
    order, at u. With `truncate` the tokens are ranked and cut by top-k, then top-p of the renormalised
    remainder (the order HF applies them); logprobs are never truncated. `greedy_rows` = (all rows greedy, any
    row greedy) when the caller knows them (the generator does, from the params): then nothing here reads a device
    value on the host, so the sampler runs without a sync and can sit in a captured CUDA graph.
    """
    if isinstance(temperature, torch.Tensor):
        greedy = temperature == 0
        all_greedy, any_greedy = greedy_rows or (bool(greedy.all()), bool(greedy.any()))
        scaled = logits if all_greedy else logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    else:  # one temperature for every row (the usual case): no per-row tensors (x / 1 is x, bit for bit)
        greedy, all_greedy, any_greedy = None, temperature == 0, temperature == 0
        scaled = logits if temperature in (0.0, 1.0) else logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1) if any_greedy else None
    if not all_greedy:
        vocab = logits.shape[1]
        probs = logp.exp()
        if truncate:  # which tokens top-k and top-p keep is decided in rank order, then applied in vocabulary order
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            rank = torch.arange(vocab, device=logits.device)
            in_top_k = rank.unsqueeze(0) < top_k.unsqueeze(1)
            ranked = sorted_probs * in_top_k
            cum = cumsum_last_dim(ranked)
            mass_before = cum - ranked  # keep a token while the mass ranked above it < top_p
            in_nucleus = (mass_before < top_p.unsqueeze(1) * cum[:, -1:]) | (top_p >= 1.0).unsqueeze(1)
            # (top_p = 1 keeps even the tail that fp32 cumsum rounds away)
            probs = probs * torch.zeros_like(in_top_k).scatter_(1, order, in_top_k & in_nucleus)
        # The CDF runs in vocabulary order for every row: a row's draw is a function of its distribution and its u
        # alone, whatever the other rows of the batch ask for (a row without top-k / top-p draws the same token in
        # a batch that truncates as in one that does not).
        cdf = cumsum_last_dim(probs)
        total = cdf[:, -1]
        target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
        drawn = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=vocab - 1)
        tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
