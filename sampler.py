"""The rollout sampler: one token per row from fp32 logits, reproducible per request.

Log-prob convention (the trainer uses the same): logprob = log_softmax(logits / temperature) over
the full vocabulary in fp32, i.e. after temperature and BEFORE top-k/top-p truncation; for greedy
(temperature 0) it is log_softmax(logits), i.e. temperature 1.

Seeds: sampling noise is counter based, u = hash(seed, index of the token in the completion), and a
token is drawn by inverting the CDF of the (truncated) distribution at u. Hence a request with a
given seed samples the same tokens whichever requests share its batch and whichever slot it lands in.
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


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    u: torch.Tensor,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return (tokens, logprobs); rows with temperature 0 are greedy.

    logits [B, V] fp32; temperature [B] fp32, or one float for all rows; top_p [B] fp32 and top_k [B]
    int64 (V when disabled), needed only with `truncate`; u [B] fp64. Sampling inverts the CDF at u.
    With `truncate` the vocabulary is sorted and cut by top-k, then top-p of the renormalised
    remainder (the order HF applies them); logprobs are never truncated.
    """
    if isinstance(temperature, torch.Tensor):
        greedy = temperature == 0
        all_greedy, any_greedy = bool(greedy.all()), bool(greedy.any())
        scaled = logits if all_greedy else logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    else:  # one temperature for every row (the usual case): no per-row tensors (x / 1 is x, bit for bit)
        greedy, all_greedy, any_greedy = None, temperature == 0, temperature == 0
        scaled = logits if temperature in (0.0, 1.0) else logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1) if any_greedy else None
    if not all_greedy:
        vocab = logits.shape[1]
        if truncate:
            sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
            probs = sorted_logp.exp()
            rank = torch.arange(vocab, device=logits.device)
            probs = probs * (rank.unsqueeze(0) < top_k.unsqueeze(1))
            cum = probs.cumsum(dim=-1)
            mass_before = cum - probs  # keep a token while the mass ranked above it < top_p
            in_nucleus = (mass_before < top_p.unsqueeze(1) * cum[:, -1:]) | (top_p >= 1.0).unsqueeze(1)
            probs = probs * in_nucleus  # (top_p = 1 keeps even the tail that fp32 cumsum rounds away)
        else:
            probs = logp.exp()
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1]
        target = torch.minimum((u * total.double()).to(cdf.dtype), torch.nextafter(total, torch.zeros_like(total)))
        idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=vocab - 1)
        drawn = order.gather(1, idx.unsqueeze(1)).squeeze(1) if truncate else idx
        tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
