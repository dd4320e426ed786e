"""Splitting a batch of variable-length sequences: across DP ranks, then into micro-batches under a token budget.

Both are deterministic functions of the lengths, so every rank of a pipeline (and every TP peer) derives the
same micro-batches from the same trajectory list without communicating.
"""

from __future__ import annotations


def _descending(lengths: list[int]) -> list[int]:
    # ties broken by index so the result never depends on sort stability quirks
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Greedy (sorted longest first): each sequence goes to the part with the fewest tokens (lowest index on ties).
    Returns `parts` index lists, each in ascending (original) order; a part may be empty."""
    if parts < 1:
        raise ValueError(f"balanced_partition: parts must be >= 1, got {parts}")
    tokens = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in _descending(lengths):
        p = min(range(parts), key=lambda j: (tokens[j], j))
        out[p].append(i)
        tokens[p] += lengths[i]
    return [sorted(p) for p in out]


def dynamic_microbatches(lengths: list[int], capacity: int, min_microbatches: int = 1) -> list[list[int]]:
    """AReaL dynamic batching (Algorithm 1): sort lengths descending; for each sequence open a new micro-batch if
    fewer than `min_microbatches` exist or none can fit it under `capacity` tokens, else put it into the fitting
    micro-batch with the fewest sequences. Returns index lists (each ascending), in the order they were opened."""
    if capacity < 1:
        raise ValueError(f"dynamic_microbatches: capacity (micro_batch_tokens) must be >= 1, got {capacity}")
    if min_microbatches < 1:
        raise ValueError(f"dynamic_microbatches: min_microbatches must be >= 1, got {min_microbatches}")
    bins: list[list[int]] = []
    tokens: list[int] = []
    for i in _descending(lengths):
        n = lengths[i]
        if n > capacity:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than micro_batch_tokens={capacity}; "
                f"raise micro_batch_tokens to at least the longest prompt+response"
            )
        fitting = [b for b in range(len(bins)) if tokens[b] + n <= capacity]
        if len(bins) < min_microbatches or not fitting:
            bins.append([i])
            tokens.append(n)
        else:
            b = min(fitting, key=lambda j: (len(bins[j]), j))
            bins[b].append(i)
            tokens[b] += n
    return [sorted(b) for b in bins]
