"""The trainer's packed attention against attention over each sequence alone (GQA written out, a plain softmax), and
its length bins: every sequence in exactly one bin, padding within the bound."""

import random

import pytest
import torch

from parallel.packed_attention import PAD_FRACTION, PackedSeqs, length_bins, packed_attention


def one_sequence(q, k, v, scaling, window):
    """[heads, L, D] causal attention of one sequence, K/V repeated over GQA groups, the softmax written out."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    pos = torch.arange(q.shape[1])
    back = pos[:, None] - pos[None, :]
    keep = (back >= 0) & (back < (window or q.shape[1] + 1))
    scores = (q @ k.transpose(1, 2) * scaling).masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seed", range(4))
def test_packed_row_equals_each_sequence_alone(seed, window):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, 5, 6, 7, 13, 30]) for _ in range(rng.randint(2, 9))]
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, total = 4, 2, 8, sum(lens)
    q = torch.randn(1, heads, total, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, total, d, generator=g, dtype=torch.float64) for _ in range(2))
    out, _ = packed_attention(
        None, q, k, v, None, scaling=0.3, sliding_window=window, packed=PackedSeqs.build(lens, "cpu")
    )
    start = 0
    for n in lens:
        s = slice(start, start + n)
        want = one_sequence(q[0, :, s], k[0, :, s], v[0, :, s], 0.3, window).transpose(0, 1)
        torch.testing.assert_close(out[0, s], want, rtol=1e-12, atol=1e-12)
        start += n
    assert out.shape == (1, total, heads, d)


def test_gradients_flow_through_every_bin():
    lens = [9, 2, 2, 7]
    q, k, v = (torch.randn(1, 2, sum(lens), 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    packed = PackedSeqs.build(lens, "cpu")
    assert len(packed.bins) > 1  # the case must cross bins
    torch.autograd.gradcheck(
        lambda q, k, v: packed_attention(None, q, k, v, None, scaling=0.5, packed=packed)[0], (q, k, v)
    )


@pytest.mark.parametrize("seed", range(20))
def test_bins_hold_every_sequence_once_within_the_padding_bound(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 200) for _ in range(rng.randint(1, 40))]
    bins = length_bins(lens)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    for b in bins:
        real = sum(lens[i] for i in b)
        assert max(lens[i] for i in b) * len(b) <= (1 + PAD_FRACTION) * real
