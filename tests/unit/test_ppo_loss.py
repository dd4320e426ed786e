"""Decoupled PPO loss against a direct numpy formula, its reduction to standard PPO, cap masking, full-vocab and
chunked log-probs/entropy (the vocab-parallel version with 2 gloo ranks: tests/dist/test_parallel_ranks.py)."""

import math

import numpy as np
import pytest
import torch

from parallel.ppo import (
    aggregation_weights,
    behaviour_correction,
    chunked_over_tokens,
    decoupled_ppo_loss,
    k3_kl,
    token_logprobs_and_entropy,
)

torch.set_num_threads(1)


def numpy_decoupled_loss(logp, prox, behav, adv, mask, eps, cap, n):
    total = 0.0
    for i in range(len(logp)):
        if not mask[i]:
            continue
        w = math.exp(prox[i] - behav[i])
        if cap > 0 and w > cap:  # cap 0 = no cap
            continue
        r = math.exp(logp[i] - prox[i])
        rc = min(max(r, 1 - eps), 1 + eps)
        total += max(-adv[i] * r, -adv[i] * rc) * w
    return total / n


def make_inputs(seed=0, n=12):
    g = np.random.default_rng(seed)
    logp = g.normal(-1.5, 0.5, n)
    prox = logp + g.normal(0, 0.3, n)
    behav = prox + g.normal(0, 0.8, n)
    adv = g.normal(0, 1.0, n)
    mask = g.random(n) > 0.25
    return logp, prox, behav, adv, mask


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_decoupled_loss_matches_formula(cap):
    logp, prox, behav, adv, mask = make_inputs()
    loss, stats = decoupled_ppo_loss(t(logp), t(prox), t(behav), t(adv), t(mask, torch.bool), 0.2, cap)
    expected = numpy_decoupled_loss(logp, prox, behav, adv, mask, 0.2, cap, mask.sum())
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    w = np.exp(prox - behav)[mask]
    assert stats["importance_weight_mean"] == pytest.approx(w.mean(), rel=1e-12)
    assert stats["importance_weight_max"] == pytest.approx(w.max(), rel=1e-12)
    keep = mask & ((np.exp(prox - behav) <= cap) if cap > 0 else True)
    assert stats["num_loss_tokens"] == keep.sum()


# ---------------------------------------------------------------------------------------------- off-policy corrections
def direct_correction(log_w, mask, seq, mode, cap, low, high):
    """(weight, keep) per token, one token and one sequence at a time, from the definitions."""
    n = len(log_w)
    w = [math.exp(log_w[i]) if mask[i] else 1.0 for i in range(n)]
    seq_ratio = {}
    for s in set(seq):
        logs = [log_w[i] for i in range(n) if seq[i] == s and mask[i]]
        total = sum(logs)
        seq_ratio[s] = math.exp(total / len(logs) if mode == "mis-geo" and logs else total)
    weight, keep = [], []
    for i in range(n):
        if mode == "mask":
            k = mask[i] and (cap <= 0 or w[i] <= cap)
        elif mode == "icepop":
            k = mask[i] and low <= w[i] <= high
        elif mode == "tis":
            k = bool(mask[i])
        else:
            k = mask[i] and low <= seq_ratio[seq[i]] <= high
        weight.append(min(w[i], cap) if mode == "tis" else w[i])
        keep.append(bool(k))
    return weight, keep


@pytest.mark.parametrize("mode", ["mask", "tis", "mis-seq", "mis-geo", "icepop"])
def test_behaviour_corrections_match_their_definitions(mode):
    g = np.random.default_rng(3)
    n = 40
    log_w = g.normal(0, 0.6, n)
    mask = g.random(n) > 0.2
    seq = np.sort(g.integers(0, 7, n))  # 7 sequences packed in one row
    cap, low, high = 1.6, 0.6, 1.7
    if mode == "mis-geo":  # a mean of ~6 log-weights varies less: tighter bounds, so the mask acts
        low, high = 0.85, 1.15
    weight, keep = behaviour_correction(t(log_w), t(mask, torch.bool), mode, cap, (low, high), t(seq, torch.long))
    want_w, want_k = direct_correction(log_w.tolist(), mask.tolist(), seq.tolist(), mode, cap, low, high)
    assert keep.tolist() == want_k
    assert 0 < sum(want_k) < mask.sum() or mode == "tis"  # the case is one where the mode acts
    np.testing.assert_allclose(weight.numpy()[mask], np.array(want_w)[mask], rtol=1e-12)


def test_aggregation_weights_and_a_weighted_loss():
    lens = [3, 1, 4]
    assert aggregation_weights(lens, "token-mean") == [1 / 8] * 3
    assert aggregation_weights(lens, "seq-mean-token-mean") == [1 / 9, 1 / 3, 1 / 12]
    assert aggregation_weights(lens, "seq-mean-token-sum") == [1 / 3] * 3
    # a loss weighted per sequence is the per-sequence losses, each a token mean, averaged over sequences
    logp, prox, behav, adv, _ = make_inputs(seed=5, n=8)
    mask = np.ones(8, dtype=bool)
    seq = [0, 0, 0, 1, 2, 2, 2, 2]
    weights = aggregation_weights(lens, "seq-mean-token-mean")
    token_weight = t([weights[s] for s in seq])
    loss, _ = decoupled_ppo_loss(
        t(logp), t(prox), t(behav), t(adv), t(mask, torch.bool), 0.2, token_weight=token_weight
    )
    per_seq = []
    for s, r in enumerate(lens):
        idx = [i for i in range(8) if seq[i] == s]
        sl = np.array(idx)
        per_seq.append(numpy_decoupled_loss(logp[sl], prox[sl], behav[sl], adv[sl], mask[sl], 0.2, 0.0, r))
    assert loss.item() == pytest.approx(sum(per_seq) / 3, rel=1e-12)


def test_k3_kl_is_its_formula_nonnegative_and_zero_at_the_reference():
    logp, _, ref, _, mask = make_inputs(seed=7)
    kl = k3_kl(t(logp, torch.float64).requires_grad_(), t(ref), t(mask, torch.bool))
    for i in range(len(logp)):
        d = ref[i] - logp[i]
        assert kl[i].item() == pytest.approx(math.exp(d) - d - 1 if mask[i] else 0.0, rel=1e-12, abs=1e-15)
    assert (kl >= 0).all() and k3_kl(t(logp), t(logp), t(mask, torch.bool)).abs().max() == 0
    lp = t(logp).requires_grad_()
    k3_kl(lp, t(ref), t(mask, torch.bool)).sum().backward()  # d/dlogp (e^d - d - 1) = 1 - e^d
    want = np.where(mask, 1 - np.exp(ref - logp), 0.0)
    np.testing.assert_allclose(lp.grad.numpy(), want, rtol=1e-12, atol=1e-15)


def test_corrections_refuse_what_they_cannot_do():
    lw, m = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="one of"):
        behaviour_correction(lw, m, "clip")
    with pytest.raises(ValueError, match="tis.*cap > 0"):
        behaviour_correction(lw, m, "tis", 0.0)
    with pytest.raises(ValueError, match="sequence index"):
        behaviour_correction(lw, m, "mis-seq")
    with pytest.raises(ValueError, match="one of"):
        aggregation_weights([1, 2], "seq-sum")


def test_global_token_normaliser_makes_splits_add_up():
    logp, prox, behav, adv, mask = make_inputs(seed=1, n=20)
    n = int(mask.sum())
    full, _ = decoupled_ppo_loss(t(logp), t(prox), t(behav), t(adv), t(mask, torch.bool), 0.2, 0.0)
    parts = sum(
        decoupled_ppo_loss(
            t(logp[s]), t(prox[s]), t(behav[s]), t(adv[s]), t(mask[s], torch.bool), 0.2, 0.0, num_valid_tokens=n
        )[0]
        for s in (slice(0, 7), slice(7, 20))
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-12)


def test_reduces_to_standard_ppo_when_prox_is_behaviour():
    logp, _, behav, adv, mask = make_inputs(seed=2)
    lp = t(logp).requires_grad_()
    loss, stats = decoupled_ppo_loss(lp, t(behav), t(behav), t(adv), t(mask, torch.bool), 0.2, 2.0)
    # standard PPO clipped surrogate written directly, ratio against the behaviour policy, no weights
    r = np.exp(logp - behav)
    ppo = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.2))[mask].sum() / mask.sum()
    assert loss.item() == pytest.approx(ppo, rel=1e-12)
    assert stats["importance_weight_mean"] == 1.0 and stats["importance_weight_max"] == 1.0
    # gradient: d/dlogp of -A r is -A r where unclipped, 0 where the clip is active
    loss.backward()
    clipped = np.where(adv > 0, r > 1.2, r < 0.8)
    grad = np.where(mask & ~clipped, -adv * r, 0.0) / mask.sum()
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-12, atol=1e-15)
    assert stats["pg_clipfrac"] == pytest.approx((clipped & mask).sum() / mask.sum())


def test_cap_masks_tokens_but_keeps_denominator():
    logp = [-1.0, -1.0, -1.0]
    behav = [-1.0, -3.0, -1.0]  # token 1 has w = e^2 > cap
    adv = [1.0, 1.0, 1.0]
    args = (t(logp), t(logp), t(behav), t(adv), t([True, True, True], torch.bool), 0.2)
    loss_capped, stats = decoupled_ppo_loss(*args, behav_imp_weight_cap=5.0)
    loss_free, _ = decoupled_ppo_loss(*args)
    assert loss_capped.item() == pytest.approx(-2.0 / 3.0)  # two kept tokens, each -1 * 1 * 1, over 3
    assert loss_free.item() == pytest.approx(-(2.0 + math.e**2) / 3.0)
    assert stats["num_loss_tokens"] == 2 and stats["importance_weight_max"] == pytest.approx(math.e**2)


def _loss_and_grad(logp, prox, behav, adv, mask, cap=0.0, num_valid_tokens=None):
    lp = t(logp).requires_grad_()
    loss, _ = decoupled_ppo_loss(lp, t(prox), t(behav), t(adv), t(mask, torch.bool), 0.2, cap, num_valid_tokens)
    loss.backward()
    return loss, lp.grad


def test_masked_inf_does_not_leak():
    # a padded token with a huge log-ratio must not turn the loss or its gradient into nan/inf
    loss, grad = _loss_and_grad([-1.0, 500.0], [-1.0, -500.0], [-1.0, -1.0], [1.0, 1.0], [True, False])
    assert torch.isfinite(loss) and loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(grad).all() and grad[1].item() == 0.0
    # the valid token alone, with the same denominator
    ref_loss, ref_grad = _loss_and_grad([-1.0], [-1.0], [-1.0], [1.0], [True], num_valid_tokens=1)
    assert loss.item() == ref_loss.item() and grad[0].item() == ref_grad[0].item()


def test_capped_inf_weight_does_not_leak():
    # token 1 is valid but its weight overflows to inf and is capped away; its gradient must be exactly 0
    loss, grad = _loss_and_grad(
        [-1.0, 500.0, -1.6], [-1.0, 400.0, -1.5], [-1.0, -1e4, -1.0], [1.0, -1.0, -0.5], [True, True, True], cap=5.0
    )
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad[1].item() == 0.0
    # the kept tokens alone, with the denominator that still counts the capped token
    ref_loss, ref_grad = _loss_and_grad(
        [-1.0, -1.6], [-1.0, -1.5], [-1.0, -1.0], [1.0, -0.5], [True, True], num_valid_tokens=3
    )
    assert loss.item() == ref_loss.item()
    assert grad[[0, 2]].tolist() == ref_grad.tolist()


def test_bad_inputs():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        decoupled_ppo_loss(x, x, x, torch.zeros(4), x.bool(), 0.2)
    with pytest.raises(ValueError, match="num_valid_tokens"):
        decoupled_ppo_loss(x, x, x, x, x.bool(), 0.2)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 0.0)


def test_full_vocab_logprobs_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    logp, ent = token_logprobs_and_entropy(logits, torch.tensor([2, 0]), temperature=0.5)
    z = np.array([2.0, 4.0, 6.0])
    p = np.exp(z) / np.exp(z).sum()
    assert logp[0].item() == pytest.approx(np.log(p[2]), rel=1e-6)
    assert ent[0].item() == pytest.approx(-(p * np.log(p)).sum(), rel=1e-6)
    assert logp[1].item() == pytest.approx(-math.log(3), rel=1e-6)
    assert ent[1].item() == pytest.approx(math.log(3), rel=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 0])
def test_chunked_logprobs_equal_one_call_in_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(chunk)
    logits = (torch.randn(1, 13, 50, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, 50, (1, 13), generator=g)
    coef = torch.randn(2, 1, 13, generator=g)

    def fn(x, t):
        return token_logprobs_and_entropy(x, t, 0.8)

    lp, ent = fn(logits, targets)
    ((lp * coef[0]).sum() + (ent * coef[1]).sum()).backward()
    grad, logits.grad = logits.grad.clone(), None
    lp_c, ent_c = chunked_over_tokens(fn, logits, targets, chunk)
    ((lp_c * coef[0]).sum() + (ent_c * coef[1]).sum()).backward()
    assert (lp_c - lp).abs().max() <= 1e-6 and (ent_c - ent).abs().max() <= 1e-6
    assert (logits.grad - grad).abs().max() <= 1e-6
    with torch.no_grad():  # forward only (pi_prox recompute): plain chunks, same values
        lp_n, _ = chunked_over_tokens(fn, logits, targets, chunk)
    assert (lp_n - lp).abs().max() <= 1e-6
