"""Decoupled PPO loss and token log-probabilities (full-vocab and vocab-parallel).

Pure functions over tensors. The trainer, the single-process reference in the tests and other modules all use
these, so a layout (DP/TP/PP, micro-batching) can only change *where* terms are summed, never the formula.

Conventions
- log-probs are log_softmax(logits / temperature) over the full vocabulary, exactly like the generator records
  behaviour log-probs (before any top-p/top-k truncation).
- the loss is a token *sum* divided by `num_valid_tokens`, the count over the whole minibatch, so summing the
  partial losses of any split of the minibatch gives the same number (and the same gradient).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# ----------------------------------------------------------------------------------------------------------------
# decoupled PPO (AReaL): three policies, pi_theta (current), pi_prox (proximal), pi_behav (behaviour / rollout)


CORRECTIONS = ("mask", "tis", "mis-seq", "mis-geo", "icepop")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def behaviour_correction(
    log_w: torch.Tensor,
    valid: torch.Tensor,
    mode: str = "mask",
    cap: float = 0.0,
    bounds: tuple[float, float] = (0.5, 2.0),
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy correction of the behaviour importance weight w = pi_prox / pi_behav = exp(log_w), per token.
    Returns (weight, keep): the factor each kept token's surrogate is multiplied by, and which tokens are kept.
      mask     AReaL: tokens with w > cap are dropped (cap 0: none), kept ones weigh w
      tis      token-level truncated IS: no token dropped, weight min(w, cap)
      mis-seq  sequence-level mask: a sequence whose ratio prod(w) falls outside `bounds` is dropped whole
      mis-geo  the same on the geometric mean exp(mean(log w)) of the sequence
      icepop   two-sided token mask: tokens with w outside `bounds` are dropped
    Kept tokens of the masking modes weigh w. `seq_index` (the sequence of each token) is needed by mis-*.
    Dropped tokens stay in the loss's denominator (aggregation), so dropping never inflates the gradient."""
    if mode not in CORRECTIONS:
        raise ValueError(f"behaviour correction must be one of {CORRECTIONS}, got {mode!r}")
    log_w = torch.where(valid, log_w, 0.0)
    w = torch.exp(log_w)
    low, high = bounds
    if mode == "mask":
        return w, (valid & (w <= cap)) if cap > 0 else valid
    if mode == "tis":
        if cap <= 0:
            raise ValueError("behaviour correction 'tis' needs a cap > 0 (train.behav_imp_weight_cap)")
        return w.clamp(max=cap), valid
    if mode == "icepop":
        return w, valid & (w >= low) & (w <= high)
    if seq_index is None:
        raise ValueError(f"behaviour correction {mode!r} needs the sequence index of every token")
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    flat_valid, flat_idx = valid.reshape(-1), seq_index.reshape(-1)
    seq_log = torch.zeros(n, dtype=torch.float64, device=log_w.device)
    seq_log.index_add_(0, flat_idx[flat_valid], log_w.reshape(-1)[flat_valid].double())
    if mode == "mis-geo":
        count = torch.zeros(n, dtype=torch.float64, device=log_w.device)
        count.index_add_(0, flat_idx[flat_valid], torch.ones_like(seq_log[flat_idx[flat_valid]]))
        seq_log = seq_log / count.clamp(min=1)
    seq_ok = (seq_log >= math.log(low)) & (seq_log <= math.log(high))
    return w, valid & seq_ok[seq_index]


def aggregation_weights(response_lengths: list[int], mode: str = "token-mean") -> list[float]:
    """Loss weight of each response token of each sequence of one minibatch (all DP ranks):
      token-mean           1 / (tokens in the minibatch)          (AReaL, DAPO)
      seq-mean-token-mean  1 / (sequences x the sequence's tokens) (GRPO's original)
      seq-mean-token-sum   1 / sequences                           (Dr. GRPO-style sums per sequence)
    The loss is the weighted token sum, so any split of the minibatch sums to the same loss and gradient."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    n_seq, n_tok = len(response_lengths), sum(response_lengths)
    if mode == "token-mean":
        return [1.0 / max(n_tok, 1)] * n_seq
    if mode == "seq-mean-token-mean":
        return [1.0 / (n_seq * max(r, 1)) for r in response_lengths]
    return [1.0 / n_seq] * n_seq


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) at the sampled tokens (Schulman): exp(d) - d - 1 with
    d = ref_logp - logp; >= 0, unbiased for sampled tokens, its gradient flows through logp. 0 outside `mask`."""
    mask = mask.bool()
    d = torch.where(mask, ref_logp.detach(), 0.0) - torch.where(mask, logp, 0.0)
    return torch.where(mask, torch.exp(d) - d - 1, 0.0)


def decoupled_ppo_terms(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    behav_imp_weight_cap: float = 0.0,
    correction: str = "mask",
    bounds: tuple[float, float] = (0.5, 2.0),
    seq_index: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token terms of the decoupled PPO objective; every tensor has the shape of `logp`.

    Returns pg (clipped surrogate, already multiplied by the corrected behaviour weight and the loss mask),
    loss_mask (tokens kept by the correction, bool), clipped (bool, token where the clipped branch is active),
    imp_weight (w = pi_prox / pi_behav, uncorrected, no grad; 1 at tokens outside `mask`).
    Tokens outside the loss mask contribute exactly 0 to pg and to its gradient, whatever values they hold.
    """
    shapes = {t.shape for t in (logp, prox_logp, behav_logp, advantages, mask)}
    if len(shapes) != 1:
        raise ValueError(f"decoupled_ppo_loss: all inputs must have the same shape, got {sorted(map(tuple, shapes))}")
    if clip_eps <= 0:
        raise ValueError(f"decoupled_ppo_loss: clip_eps must be > 0, got {clip_eps}")
    valid = mask.bool()
    # Masked-out tokens (padding, capped weights) may hold arbitrary values; they are replaced by 0 *before* exp()
    # and the products, because a torch.where on the output alone keeps the forward finite but its backward still
    # multiplies 0 by the inf/nan of the unselected branch.
    prox_logp = torch.where(valid, prox_logp.detach(), 0.0)
    log_w = prox_logp - torch.where(valid, behav_logp.detach(), 0.0)
    weight, loss_mask = behaviour_correction(log_w, valid, correction, behav_imp_weight_cap, bounds, seq_index)
    imp_weight = torch.exp(torch.where(valid, log_w, 0.0))
    ratio = torch.exp(torch.where(loss_mask, logp, 0.0) - torch.where(loss_mask, prox_logp, 0.0))
    advantages = torch.where(loss_mask, advantages, 0.0)
    clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)
    pg = pg * torch.where(loss_mask, weight, 0.0)
    clipped = (pg_clipped > pg_unclipped) & loss_mask
    return {"pg": pg, "loss_mask": loss_mask, "clipped": clipped, "imp_weight": imp_weight, "valid": valid}


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    behav_imp_weight_cap: float = 0.0,
    num_valid_tokens: int | float | torch.Tensor | None = None,
    correction: str = "mask",
    bounds: tuple[float, float] = (0.5, 2.0),
    seq_index: torch.Tensor | None = None,
    token_weight: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = sum(max(-A r, -A clip(r, 1-eps, 1+eps)) * c(w) * keep * token_weight),
    r = exp(logp - prox_logp), w = exp(prox_logp - behav_logp) (no grad), (c, keep) = behaviour_correction;
    token_weight defaults to 1 / num_valid_tokens (token-mean; masked tokens stay in the denominator).
    prox_logp == behav_logp gives standard PPO.

    stats (over the tokens of `mask`): pg_clipfrac (fraction of loss tokens where the clip is active),
    importance_weight_mean / importance_weight_max, num_valid_tokens, num_loss_tokens.
    """
    terms = decoupled_ppo_terms(
        logp, prox_logp, behav_logp, advantages, mask, clip_eps, behav_imp_weight_cap, correction, bounds, seq_index
    )
    valid = terms["valid"]
    n_valid = int(valid.sum())
    if token_weight is None:
        if num_valid_tokens is None:
            num_valid_tokens = n_valid
        if float(num_valid_tokens) <= 0:
            raise ValueError("decoupled_ppo_loss: num_valid_tokens must be > 0 (no response token in the batch?)")
        loss = terms["pg"].sum() / num_valid_tokens
    else:
        loss = (terms["pg"] * token_weight).sum()
    n_loss = int(terms["loss_mask"].sum())
    w = terms["imp_weight"][valid]
    stats = {
        "pg_clipfrac": float(terms["clipped"].sum()) / max(n_loss, 1),
        "importance_weight_mean": float(w.mean()) if n_valid else 0.0,
        "importance_weight_max": float(w.max()) if n_valid else 0.0,
        "num_valid_tokens": float(n_valid),
        "num_loss_tokens": float(n_loss),
    }
    return loss, stats


# ----------------------------------------------------------------------------------------------------------------
# log-probs and entropy over the full vocabulary


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V], targets [...] -> (log p(target), entropy), fp32, under softmax(logits / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked_over_tokens(fn, logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
    """fn(logits, targets) -> (logp, entropy), applied to slices of `chunk_tokens` tokens (the last dim of
    `targets`), so the fp32 [tokens, vocab] softmax exists for one chunk at a time, never for a whole micro-batch.
    Under autograd each chunk is checkpointed (torch.utils.checkpoint): its softmax is recomputed in backward
    instead of kept. Same values and gradients as one call, row by row (chunk_tokens 0: one call)."""
    n = targets.shape[-1]
    if chunk_tokens <= 0 or n <= chunk_tokens:
        return fn(logits, targets)
    keep_graph = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, n, chunk_tokens):
        piece = (logits[..., start : start + chunk_tokens, :], targets[..., start : start + chunk_tokens])
        parts.append(checkpoint(fn, *piece, use_reentrant=False) if keep_graph else fn(*piece))
    return torch.cat([p[0] for p in parts], -1), torch.cat([p[1] for p in parts], -1)


# ----------------------------------------------------------------------------------------------------------------
# vocab-parallel version: each TP rank holds logits for vocab rows [vocab_start, vocab_start + V_local)


class _AllReduceSum(torch.autograd.Function):
    """Forward: all-reduce SUM over the TP group. Backward: identity.

    Every TP rank computes the same replicated loss from the reduced value, so each rank's local summand receives
    the loss gradient exactly once (Megatron's "reduce from model-parallel region")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def vocab_parallel_logprobs_and_entropy(
    local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp_group, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as token_logprobs_and_entropy on the concatenated logits, without materialising them.

    Communicates three [...]-sized tensors over tp_group (max, sum-exp, target logit + sum p*z); differentiable
    w.r.t. local_logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"local logits {tuple(local_logits.shape)} and targets {tuple(targets.shape)} do not match")
    z = local_logits.float() / temperature
    v_local = z.shape[-1]
    # the max only stabilises exp(); it cancels exactly in the maths, so no gradient flows through it
    z_max = z.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - z_max
    exp_shifted = shifted.exp()
    sum_exp = _AllReduceSum.apply(exp_shifted.sum(-1), tp_group)
    log_sum_exp = sum_exp.log()

    local_target = targets.long() - vocab_start
    in_shard = (local_target >= 0) & (local_target < v_local)
    safe_index = torch.where(in_shard, local_target, torch.zeros_like(local_target))
    target_shifted = shifted.gather(-1, safe_index.unsqueeze(-1)).squeeze(-1)
    target_shifted = torch.where(in_shard, target_shifted, torch.zeros_like(target_shifted))
    # one all-reduce for both the target logit and sum_v exp(z_v) * z_v (the entropy's expectation term)
    stacked = torch.stack([target_shifted, (exp_shifted * shifted).sum(-1)], dim=0)
    stacked = _AllReduceSum.apply(stacked, tp_group)
    logp = stacked[0] - log_sum_exp
    entropy = log_sum_exp - stacked[1] / sum_exp
    return logp, entropy
