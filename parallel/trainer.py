"""The DP x TP x PP decoupled-PPO trainer. Every train rank runs the same code on the same global batch.

One train_step(trajectories):
  1. split the global batch into `ppo_minibatches` contiguous minibatches; for each, split its sequences across
     DP ranks (greedy token balance) and pack each rank's share into micro-batches under `micro_batch_tokens`
     (AReaL dynamic batching) -- deterministic, so all stages and TP peers agree without talking;
  2. decoupled PPO: pi_prox = the current parameters before any update of this step -- recomputed for the
     whole batch (forward only) when there are several minibatches, read off the training forward when there
     is one -- or pi_behav (standard PPO);
  3. per minibatch: 1F1B forward/backward (loss = token sum / global token count of the minibatch, so any split
     sums to the single-process loss), sum tied-embedding grads between first and last stage, bucketed DP
     all-reduce (SUM), clip by the global norm (each parameter counted once), AdamW step on fp32 master weights.

With dp > 1 and train.shard_state (the default) the stage is sharded over its DP group by torch's FSDP2
(`fully_shard` per decoder layer and on the stage): fp32 master weights, gradients and AdamW state are 1/dp per
rank, a layer's weights are all-gathered (in the compute dtype) just before its forward and backward, and its
gradients are reduce-scattered (fp32, SUM) right after its backward. FSDP's collectives run in every forward and
backward, so every DP rank runs the same number of micro-batches (an empty share is padded with a weightless one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from config import TrainConfig
from parallel.packed_attention import PackedSeqs, packed_position_ids
from parallel.packing import balanced_partition, dynamic_microbatches
from parallel.pipeline import StageLinks, forward_only, train_1f1b
from parallel.ppo import (
    aggregation_weights,
    chunked_over_tokens,
    decoupled_ppo_terms,
    k3_kl,
    token_logprobs_and_entropy,
    vocab_parallel_logprobs_and_entropy,
)
from parallel.stage import Stage
from parallel.sync_layout import SyncBucket, param_stage, sync_buckets


@dataclass
class MicroBatch:
    """One packed row of sequences (indices into the minibatch), aligned per position t (t predicts t+1)."""

    seqs: list[int]
    seq_lens: list[int]
    input_ids: torch.Tensor  # [1, T]
    targets: torch.Tensor  # [1, T]
    loss_mask: torch.Tensor  # [1, T] bool: t predicts a response token
    behav_logp: torch.Tensor  # [1, T]
    advantages: torch.Tensor  # [1, T]
    seq_index: torch.Tensor  # [1, T] long: which of `seqs` each position belongs to
    loss_weight: torch.Tensor  # [1, T] fp32: each response token's weight in the loss (train.loss_aggregation)
    prox_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # under the frozen reference model (train.kl_coef > 0)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class Minibatch:
    num_valid_tokens: int  # global count of response tokens (all DP ranks)
    micro: list[MicroBatch] = field(default_factory=list)  # this DP rank's share


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP DTensor's local shard (a view: writing it writes the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _check_trajectories(trajs: list, vocab_size: int) -> None:
    if not trajs:
        raise ValueError("train_step: empty trajectory list")
    for i, tr in enumerate(trajs):
        if len(tr.prompt_ids) < 1:
            raise ValueError(f"trajectory {i}: empty prompt_ids (the first response token needs a context)")
        if len(tr.behav_logprobs) != len(tr.response_ids):
            raise ValueError(
                f"trajectory {i}: {len(tr.behav_logprobs)} behav_logprobs for {len(tr.response_ids)} response tokens"
            )
        ids = list(tr.prompt_ids) + list(tr.response_ids)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"trajectory {i}: token id outside [0, {vocab_size})")
        if not all(math.isfinite(x) for x in tr.behav_logprobs) or not math.isfinite(tr.advantage):
            raise ValueError(f"trajectory {i}: non-finite behav_logprobs or advantage")


class Trainer:
    def __init__(
        self,
        model_path_or_module: Any,
        groups,
        config: TrainConfig,
        device: str | torch.device,
        *,
        temperature: float = 1.0,
        compute_dtype: torch.dtype = torch.float32,
    ):
        """`config` is the run's `train` section; `temperature` is the one the rollout samples at (log-probs
        follow it); `compute_dtype` bfloat16 means bf16 autocast over fp32 master weights and AdamW state."""
        if not groups.is_train:
            raise ValueError(f"Trainer: rank {groups.rank} has role {groups.role!r}, not 'train'")
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Trainer: compute_dtype must be float32 or bfloat16, got {compute_dtype}")
        if config.ppo_minibatches < 1:
            raise ValueError(f"train.ppo_minibatches must be >= 1, got {config.ppo_minibatches}")
        if temperature <= 0:
            raise ValueError(f"Trainer: temperature must be > 0, got {temperature}")
        self.cfg, self.groups, self.device = config, groups, torch.device(device)
        self.temperature = temperature
        torch.manual_seed(config.seed)
        hf_model = self._load(model_path_or_module)
        self.hf_config = hf_model.config
        n_layers = hf_model.config.num_hidden_layers
        if groups.stage_layers[-1][1] != n_layers:
            raise ValueError(
                f"plan stages cover layers [0,{groups.stage_layers[-1][1]}) but the model has {n_layers} layers"
            )
        # HF state-dict names and shapes (tied models list both embed_tokens and lm_head), for gather
        self.full_shapes = {
            n: tuple(t.shape)
            for n, t in hf_model.state_dict().items()
            if n.startswith(("model.embed_tokens", "model.layers.", "model.norm", "lm_head"))
        }

        self.dp_mesh, tp_mesh = self._meshes()

        def this_ranks_stage(model) -> Stage:
            g = groups
            return Stage(model, g.layers, g.is_first_stage, g.is_last_stage, tp_mesh, self.device)

        self.stage = this_ranks_stage(hf_model)
        self.stage.activation_checkpointing = config.activation_checkpointing
        # the frozen reference for the KL term (train.kl_coef > 0): the initial weights, sharded like the policy
        self.ref_stage = this_ranks_stage(hf_model).requires_grad_(False) if config.kl_coef > 0 else None
        del hf_model
        self.fsdp = config.shard_state and groups.dp > 1
        if self.fsdp:
            self._shard_over_dp(self.stage, compute_dtype)
            if self.ref_stage is not None:
                self._shard_over_dp(self.ref_stage, compute_dtype)
        self.params = dict(self.stage.named_parameters())  # DTensors (DP shards) under FSDP
        adamw = {"lr": config.lr, "betas": tuple(config.betas), "eps": config.eps, "weight_decay": config.weight_decay}
        self.optimizer = torch.optim.AdamW(self.params.values(), **adamw)
        self.links = StageLinks.from_groups(groups, self.device)
        self._sync_buckets: dict[tuple[int, int], list[SyncBucket]] = {}
        self.autocast_dtype = compute_dtype if compute_dtype != torch.float32 else None
        self.step = 0

    def _meshes(self) -> tuple[DeviceMesh, DeviceMesh | None]:
        """This stage's DP mesh (FSDP's) and TP mesh (None without TP), one 2-D mesh over the existing groups when
        both are there: FSDP2 composes with TP's DTensors when their meshes share a root."""
        g, device = self.groups, self.device.type
        if g.tp == 1:
            return DeviceMesh.from_group(g.dp_group, device_type=device), None
        first = g.pp_rank * g.dp * g.tp  # the plan's train ranks run pp-major, then dp, then tp
        ranks = g.train_ranks[first : first + g.dp * g.tp]
        grid = [ranks[d * g.tp : (d + 1) * g.tp] for d in range(g.dp)]  # a list: no tensor outlives the call
        mesh = DeviceMesh.from_group([g.dp_group, g.tp_group], device, mesh=grid, mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]

    def _shard_over_dp(self, stage: Stage, compute_dtype: torch.dtype) -> None:
        """FSDP2 over this stage's DP group: one unit per decoder layer, the stage itself holds the embedding, the
        final norm and the LM head (a tied pair must share a unit). Gradients are summed, not averaged: the loss is
        already normalised by the global token count."""
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        units = [*stage.model.layers.values(), stage]
        for unit in units:
            fully_shard(unit, mesh=self.dp_mesh, mp_policy=policy)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    @staticmethod
    def _load(src: Any):
        if isinstance(src, torch.nn.Module):
            return src
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)

    # ------------------------------------------------------------------------------------------------------------
    # batching

    def _min_microbatches(self) -> int:
        return self.cfg.min_microbatches or self.groups.pp

    def _minibatch(self, trajs: list) -> Minibatch:
        g = self.groups
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        num_valid = sum(len(t.response_ids) for t in trajs)
        shares = balanced_partition(lengths, g.dp)
        mine = shares[g.dp_rank]
        packs = self._pack(lengths, shares)
        # weights from the whole minibatch (every DP rank sees it), so the DP/micro-batch split sums to the same loss
        token_weight = aggregation_weights([len(t.response_ids) for t in trajs], self.cfg.loss_aggregation)
        mb = Minibatch(num_valid_tokens=num_valid)
        for pack in packs:
            if not pack:  # FSDP padding: a one-token row that carries no loss but runs the collectives
                mb.micro.append(self._weightless_microbatch())
                continue
            seqs = [mine[j] for j in pack]
            ids, tgt, mask, behav, adv, index, weight = [], [], [], [], [], [], []
            for k, i in enumerate(seqs):
                tr = trajs[i]
                seq = list(tr.prompt_ids) + list(tr.response_ids)
                p, r = len(tr.prompt_ids), len(tr.response_ids)
                ids += seq
                tgt += seq[1:] + [0]
                mask += [False] * (p - 1) + [True] * r + [False]
                behav += [0.0] * (p - 1) + [float(x) for x in tr.behav_logprobs] + [0.0]
                adv += [0.0] * (p - 1) + [float(tr.advantage)] * r + [0.0]
                index += [k] * len(seq)
                # train.overlong=mask: a truncated response carries no loss (its tokens stay in the denominator)
                truncated = self.cfg.overlong == "mask" and getattr(tr, "finish_reason", "stop") == "length"
                weight += [0.0] * (p - 1) + [0.0 if truncated else token_weight[i]] * r + [0.0]

            def as_row(xs: list, dt: torch.dtype) -> torch.Tensor:
                return torch.tensor(xs, dtype=dt, device=self.device)[None]

            mb.micro.append(
                MicroBatch(
                    seqs,
                    [lengths[i] for i in seqs],
                    as_row(ids, torch.long),
                    as_row(tgt, torch.long),
                    as_row(mask, torch.bool),
                    as_row(behav, torch.float32),
                    as_row(adv, torch.float32),
                    as_row(index, torch.long),
                    as_row(weight, torch.float32),
                )
            )
        return mb

    def _pack(self, lengths: list[int], shares: list[list[int]]) -> list[list[int]]:
        """This DP rank's micro-batches (indices into its share). Under FSDP every DP rank must run the same number
        of them (each forward and backward is a DP collective): each rank packs every share, and all aim for the
        largest count; a share with fewer sequences than that is padded with empty micro-batches."""
        cap, k = self.cfg.micro_batch_tokens, self._min_microbatches()

        def packs(share: list[int], k: int) -> list[list[int]]:
            return dynamic_microbatches([lengths[i] for i in share], cap, k)

        if not self.fsdp:
            return packs(shares[self.groups.dp_rank], k)
        while True:  # forcing more bins can (rarely) push a share past the target: repeat until all agree
            target = max(len(packs(share, k)) for share in shares)
            if target == k:
                break
            k = target
        mine = packs(shares[self.groups.dp_rank], k)
        return mine + [[] for _ in range(k - len(mine))]

    def _weightless_microbatch(self) -> MicroBatch:
        def zeros(dt: torch.dtype) -> torch.Tensor:
            return torch.zeros((1, 1), dtype=dt, device=self.device)

        mask = zeros(torch.bool)
        return MicroBatch(
            [], [1], zeros(torch.long), zeros(torch.long), mask, *(zeros(torch.float32) for _ in range(2)),
            zeros(torch.long), zeros(torch.float32),
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------------------
    # forward pieces

    def _stage_forward(
        self, m: MicroBatch, x: torch.Tensor | None, stage: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """first stage reads token ids; returns hidden (fp32, to travel) or, on the last stage, local logits"""
        inp = m.input_ids if self.groups.is_first_stage else x
        pos = packed_position_ids(m.seq_lens, self.device)
        packed = PackedSeqs.build(m.seq_lens, self.device)
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        ):
            out = (stage or self.stage)(inp, pos, packed)
        return out if self.groups.is_last_stage else out.float()

    def _logprobs(self, local_logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-prob and entropy, train.logprob_chunk_tokens tokens at a time (parallel/ppo.py)."""
        g = self.groups
        if g.tp == 1:

            def fn(logits, tgt):
                return token_logprobs_and_entropy(logits, tgt, self.temperature)
        else:

            def fn(logits, tgt):
                return vocab_parallel_logprobs_and_entropy(
                    logits, tgt, self.stage.vocab_start, g.tp_group, self.temperature
                )

        return chunked_over_tokens(fn, local_logits, targets, self.cfg.logprob_chunk_tokens)

    def _act_shape(self, micro: list[MicroBatch]):
        hidden = self.hf_config.hidden_size
        return lambda i: (1, micro[i].num_tokens, hidden)

    @torch.no_grad()
    def _forward_logprobs(self, minibatches: list[Minibatch], stage: torch.nn.Module, field: str) -> None:
        """A forward-only pipeline sweep of `stage` (the policy for pi_prox, the frozen reference for the KL)
        over every micro-batch; the last stage stores the target log-probs in each micro-batch's `field`."""
        micro = [m for mb in minibatches for m in mb.micro]

        def step(i: int, x):
            out = self._stage_forward(micro[i], x, stage)
            if self.groups.is_last_stage:
                return self._logprobs(out, micro[i].targets)[0]
            return out

        outs = forward_only(self.links, len(micro), self._act_shape(micro), step)
        for m, logp in zip(micro, outs):
            setattr(m, field, logp.float())

    # ------------------------------------------------------------------------------------------------------------
    # one minibatch: forward/backward, gradient synchronisation

    def forward_backward(self, minibatch: Minibatch, prox_from_forward: bool = False) -> torch.Tensor:
        """Accumulates this rank's gradients for the minibatch (after tied-embedding and DP reduction).
        prox_from_forward: pi_prox := the current parameters, read off this forward (detached).
        Returns local stat sums [loss, n_valid, n_loss, clipped, w_sum, entropy_sum, kl_sum, w_max] (zeros off the
        last stage)."""
        for p in self.params.values():
            p.grad = None if self.fsdp else torch.zeros_like(p)  # FSDP accumulates into its sharded gradients
        stats = torch.zeros(8, dtype=torch.float64, device=self.device)
        micro = minibatch.micro

        def step(i: int, x):
            m = micro[i]
            out = self._stage_forward(m, x)
            if not self.groups.is_last_stage:
                return out
            logp, entropy = self._logprobs(out, m.targets)
            if prox_from_forward:
                prox = logp.detach()
            else:
                prox = m.prox_logp if m.prox_logp is not None else m.behav_logp
            c = self.cfg
            t = decoupled_ppo_terms(
                logp,
                prox,
                m.behav_logp,
                m.advantages,
                m.loss_mask,
                c.clip_eps,
                c.behav_imp_weight_cap,
                c.behav_correction,
                tuple(c.behav_correction_bounds),
                m.seq_index,
            )
            loss = (t["pg"] * m.loss_weight).sum()
            valid = t["valid"]
            kl = torch.zeros((), device=self.device)
            if m.ref_logp is not None:  # KL to the frozen reference, same aggregation as the surrogate
                per_token = k3_kl(logp, m.ref_logp, valid)
                loss = loss + c.kl_coef * (per_token * m.loss_weight).sum()
                kl = per_token.detach().sum()
            w = t["imp_weight"][valid]
            stats.add_(
                torch.stack(
                    [
                        loss.detach(),
                        valid.sum(),
                        t["loss_mask"].sum(),
                        t["clipped"].sum(),
                        w.sum(),
                        entropy.detach()[valid].sum(),
                        kl,
                        torch.zeros((), device=self.device),
                    ]
                ).double()
            )
            if w.numel():
                stats[7] = torch.maximum(stats[7], w.max().double())
            return loss

        train_1f1b(self.links, len(micro), self._act_shape(micro), step, self.groups.pp_rank, self.groups.pp)
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sync_grads()
        return stats

    def _tied_across_stages(self) -> bool:
        return self.stage.tied and self.groups.pp > 1

    def _sync_grads(self) -> None:
        g = self.groups
        if self._tied_across_stages() and (g.is_first_stage or g.is_last_stage):
            name = "model.embed_tokens.weight" if g.is_first_stage else "lm_head.weight"
            # under FSDP both copies are sharded alike (same DP degree, same shape): their local shards pair up
            dist.all_reduce(local(self.params[name].grad), group=g.embedding_group)
        for name in sorted(self.stage.tp_partial_grads & self.params.keys()):  # each TP rank saw its own heads
            dist.all_reduce(local(self.params[name].grad), group=g.tp_group)
        if g.dp > 1 and not self.fsdp:  # FSDP reduce-scattered each layer's gradients in its backward
            self._allreduce_buckets([local(p.grad) for p in self.params.values()], g.dp_group)

    def _allreduce_buckets(self, grads: list[torch.Tensor], group) -> None:
        """SUM all-reduce in flat buckets of about grad_bucket_mb (last layers first, like DDP). Ours because torch's
        `replicate` is private in this torch (torch.distributed._composable) and would reduce after every
        micro-batch's backward under 1F1B, where one reduction per minibatch is all the replicated mode needs."""
        limit = int(self.cfg.grad_bucket_mb * 2**20)
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for grad in reversed(grads):
            nbytes = grad.numel() * grad.element_size()
            if buckets[-1] and size + nbytes > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(grad)
            size += nbytes
        for bucket in buckets:
            if not bucket:
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the full model's gradient: sharded params summed over TP, replicated ones (norms, row-parallel
        biases) once, the tied lm_head copy not at all, DP replicas once (under FSDP each DP rank its own shard)."""
        g = self.groups
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if g.dp_rank == 0 or self.fsdp:
            for name, p in self.params.items():
                if self.stage.replicated_over_tp(name) and g.tp_rank != 0:
                    continue
                if name == "lm_head.weight" and self._tied_across_stages():
                    continue
                sq += local(p.grad).double().pow(2).sum()
        with self.links.waiting():  # every stage waits here for the slowest one's last backward
            dist.all_reduce(sq, group=g.train_group)
        return sq.sqrt().float()

    # ------------------------------------------------------------------------------------------------------------
    # public API

    def train_step(self, trajectories: list) -> dict[str, float]:
        g, cfg = self.groups, self.cfg
        _check_trajectories(trajectories, self.hf_config.vocab_size)
        k = cfg.ppo_minibatches
        if len(trajectories) < k:
            raise ValueError(f"train_step: {len(trajectories)} trajectories cannot fill ppo_minibatches={k}")
        bounds = [round(j * len(trajectories) / k) for j in range(k + 1)]
        minibatches = [self._minibatch(trajectories[bounds[j] : bounds[j + 1]]) for j in range(k)]
        for j, mb in enumerate(minibatches):
            if mb.num_valid_tokens == 0:
                raise ValueError(f"train_step: minibatch {j} has no response tokens to train on")
        # pi_prox = the parameters before this step's first update: with one minibatch that is exactly the
        # training forward's own log-probs (detached), so the separate recompute pass (~1/4 of a step) is skipped
        prox_from_forward = cfg.recompute_prox_logprobs and k == 1
        if cfg.recompute_prox_logprobs and not prox_from_forward:
            self._forward_logprobs(minibatches, self.stage, "prox_logp")
        if self.ref_stage is not None:
            self._forward_logprobs(minibatches, self.ref_stage, "ref_logp")

        totals = torch.zeros(8, dtype=torch.float64, device=self.device)
        grad_norms = []
        for mb in minibatches:
            stats = self.forward_backward(mb, prox_from_forward)
            norm = self.global_grad_norm()
            grad_norms.append(norm.item())
            if cfg.grad_clip > 0:
                coef = (cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
                for p in self.params.values():
                    local(p.grad).mul_(coef.to(p.grad.dtype))
            self._optimizer_step_if_finite(norm)
            w_max = stats[7].clone()
            totals[:7] += stats[:7]
            totals[7] = torch.maximum(totals[7], w_max)
        self.step += 1

        sums, w_max = self._reduce_stats(totals)
        n_mb = torch.tensor([float(len(mb.micro)) for mb in minibatches], device=self.device).sum()
        if g.pp_rank != 0 or g.tp_rank != 0:
            n_mb.zero_()
        with self.links.waiting():
            dist.all_reduce(n_mb, group=g.train_group)
        loss, n_valid, n_loss, clipped, w_sum, ent_sum, kl_sum = sums
        return {
            "loss": loss / k,
            "grad_norm": sum(grad_norms) / k,
            "pg_clipfrac": clipped / max(n_loss, 1.0),
            "importance_weight_mean": w_sum / max(n_valid, 1.0),
            "importance_weight_max": w_max,
            "entropy": ent_sum / max(n_valid, 1.0),
            "kl_ref": kl_sum / max(n_valid, 1.0),  # k3 estimate of KL(pi_theta || pi_ref), 0 without a reference
            "trained_tokens": n_valid,
            "num_microbatches": n_mb.item(),
        }

    def _optimizer_step_if_finite(self, global_grad_norm: torch.Tensor) -> bool:
        """A NaN/inf gradient (every rank sees the same all-reduced norm) skips the update on every rank, so
        neither the weights nor the AdamW moments are poisoned; the caller sees the non-finite grad_norm."""
        if not torch.isfinite(global_grad_norm):
            for p in self.params.values():
                p.grad = None
            return False
        self.optimizer.step()
        return True

    def _reduce_stats(self, totals: torch.Tensor) -> tuple[list[float], float]:
        """stats live on the last stage, replicated over TP: count TP rank 0 only, sum over DP (max for w)"""
        g = self.groups
        if not (g.is_last_stage and g.tp_rank == 0):
            totals = torch.zeros_like(totals)
        sums, w_max = totals[:7].clone(), totals[7:].clone()
        with self.links.waiting():
            dist.all_reduce(sums, group=g.train_group)
            dist.all_reduce(w_max, op=dist.ReduceOp.MAX, group=g.train_group)
        return sums.tolist(), w_max.item()

    def compute_gradients(self, trajectories: list) -> float:
        """The whole batch as one minibatch: leaves the synchronised (unclipped) gradients in the parameters,
        takes no optimizer step; returns the loss (same on all ranks). For tests and diagnostics."""
        _check_trajectories(trajectories, self.hf_config.vocab_size)
        mb = self._minibatch(trajectories)
        if self.ref_stage is not None:
            self._forward_logprobs([mb], self.ref_stage, "ref_logp")
        return self._reduce_stats(self.forward_backward(mb, self.cfg.recompute_prox_logprobs))[0][0]

    # ------------------------------------------------------------------------------------------------------------
    # weights out: full HF state dict on the train head; checkpoints

    def sync_param_table(self) -> list[tuple[str, int]]:
        """(HF name, numel) of what weight sync sends, in state-dict order: a tied model sends no lm_head."""
        return [
            (n, math.prod(shape))
            for n, shape in self.full_shapes.items()
            if not (n == "lm_head.weight" and self.stage.tied)
        ]

    def sync_buckets(self, itemsize: int, bucket_bytes: int) -> list[SyncBucket]:
        """The weight-sync schedule of this model and layout (the planner prices the same function's buckets)."""
        key = (itemsize, bucket_bytes)
        if key not in self._sync_buckets:
            stages = [tuple(x) for x in self.groups.stage_layers]
            self._sync_buckets[key] = sync_buckets(self.sync_param_table(), stages, itemsize, bucket_bytes)
        return self._sync_buckets[key]

    @torch.no_grad()
    def _unsharded(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """This rank's TP slice of a parameter, whole over DP, in `dtype`: under FSDP an all-gather over the DP group
        of this one tensor (COLLECTIVE over it), cast before it travels."""
        p = self.params[name].detach()
        if not isinstance(p, DTensor):
            return p
        names = p.device_mesh.mesh_dim_names or ()
        whole_over_dp = [x if i < len(names) and names[i] == "tp" else Replicate() for i, x in enumerate(p.placements)]
        return p.to(dtype).redistribute(p.device_mesh, whole_over_dp).to_local()

    @torch.no_grad()
    def fill_bucket(
        self, bucket: SyncBucket, out: torch.Tensor | None, dtype: torch.dtype, tp_gather: bool = True
    ) -> None:
        """COLLECTIVE over this stage's TP group (the sending DP replica) and, under FSDP, over its DP group (every DP
        replica of the stage: the others pass tp_gather=False and only lend their shards). The stage owner (tp 0)
        passes `out`, the bucket's flat payload in the sync `dtype`, and gets the full HF tensors written into it;
        TP peers pass None. One tensor at a time is gathered, in the sync dtype."""
        g, offset = self.groups, 0
        for name, numel in zip(bucket.names, bucket.numels):
            shape = self.full_shapes[name]
            slot = None if out is None else out[offset : offset + numel].view(shape)
            offset += numel
            p = self._unsharded(name, dtype)
            if not tp_gather:
                continue
            dim = self.stage.shard_specs.get(name)
            if dim is None or g.tp == 1:
                if slot is not None:
                    slot.copy_(p)
                continue
            shard = p.to(dtype).contiguous()
            parts = [torch.empty_like(shard) for _ in range(g.tp)] if slot is not None else None
            dist.gather(shard, parts, dst=g.tp_ranks[0], group=g.tp_group)
            if slot is not None:
                torch.cat(parts, dim=dim, out=slot)
            del parts, shard

    @torch.no_grad()
    def gather_full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every train rank calls. Train head gets {HF name: fp32 CPU tensor} (bitwise copies); others None."""
        g = self.groups
        if g.dp_rank != 0 and not self.fsdp:
            return None
        names = [n for n in self.full_shapes if not (n == "lm_head.weight" and self.stage.tied)]
        mine = [n for n in names if param_stage(n, self.groups.stage_layers) == g.pp_rank]
        full: dict[str, torch.Tensor] = {}
        for n in mine:
            p = self._unsharded(n, torch.float32)  # under FSDP every DP rank takes part; DP rank 0 keeps it
            if g.dp_rank != 0:
                continue
            dim = self.stage.shard_specs.get(n)
            if dim is None or g.tp == 1:
                full[n] = p.detach()
            else:
                parts = [torch.empty_like(p) for _ in range(g.tp)]
                dist.all_gather(parts, p.detach().contiguous(), group=g.tp_group)
                full[n] = torch.cat(parts, dim=dim)
        if g.dp_rank != 0 or g.tp_rank != 0:
            return None
        # other stages' (dp 0, tp 0) ranks send one flat fp32 buffer each to the head, in name order
        if g.pp_rank != 0:
            flat = torch.cat([full[n].float().reshape(-1) for n in mine])
            dist.send(flat, g.pp_ranks[0], group=g.pp_group)
            return None
        out = {n: t.float().cpu().clone() for n, t in full.items()}
        for s in range(1, g.pp):
            theirs = [n for n in names if param_stage(n, self.groups.stage_layers) == s]
            flat = torch.empty(sum(math.prod(self.full_shapes[n]) for n in theirs), device=self.device)
            dist.recv(flat, g.pp_ranks[s], group=g.pp_group)
            offset = 0
            for n in theirs:
                size = math.prod(self.full_shapes[n])
                out[n] = flat[offset : offset + size].view(self.full_shapes[n]).cpu().clone()
                offset += size
        if self.stage.tied:
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        return {n: out[n] for n in self.full_shapes}

    def _layout(self) -> dict:
        g = self.groups
        return {
            "dp": g.dp,
            "tp": g.tp,
            "pp": g.pp,
            "dp_rank": g.dp_rank,
            "tp_rank": g.tp_rank,
            "pp_rank": g.pp_rank,
            "stage_layers": [list(x) for x in g.stage_layers],
            "fsdp": self.fsdp,
        }

    def checkpoint_state(self) -> dict:
        """This rank's shard: its stage / TP slice of the weights and its AdamW state -- under FSDP its 1/dp of both
        (every rank writes weights); otherwise the DP replicas hold the same weights and only DP rank 0 writes them."""
        writes_weights = self.fsdp or self.groups.dp_rank == 0
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {
            i: {k: local(v).cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()}
            for i, st in optimizer["state"].items()
        }
        return {
            "model": {n: local(p).detach().cpu().clone() for n, p in self.params.items()} if writes_weights else None,
            "optimizer": optimizer,
            "step": self.step,
            "layout": self._layout(),
        }

    def load_checkpoint_state(self, state: dict, weights: dict | None = None) -> None:
        """`weights`: the stage's weights when this rank's shard holds none (DP rank > 0 without FSDP: its DP rank
        0's). The layout (DP, TP, PP degrees, this rank's place, FSDP or not) must be the one saved."""
        if state.get("layout") != self._layout():
            raise ValueError(
                f"checkpoint layout {state.get('layout')} does not match this rank's {self._layout()} "
                "(resume needs the same train layout)"
            )
        weights = state["model"] if state["model"] is not None else weights
        if weights is None:
            raise ValueError("the shard holds no weights and none were given (DP rank 0's shard is missing)")
        missing = set(self.params) ^ set(weights)
        if missing:
            raise ValueError(f"checkpoint parameter names differ from this shard's: {sorted(missing)[:5]}")
        with torch.no_grad():
            for n, p in self.params.items():
                if weights[n].shape != local(p).shape:
                    raise ValueError(
                        f"checkpoint shard of {n} has shape {tuple(weights[n].shape)}, not {tuple(local(p).shape)}"
                    )
                local(p).copy_(weights[n])
        params = list(self.params.values())
        optimizer = dict(state["optimizer"])

        def restore(i: int, v):  # a moment saved as this rank's local shard becomes a DTensor like its parameter
            p = params[i]
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == local(p).shape and v.dim() > 0:
                return DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            return v

        optimizer["state"] = {
            i: {k: restore(int(i), v) for k, v in st.items()} for i, st in state["optimizer"]["state"].items()
        }
        self.optimizer.load_state_dict(optimizer)
        self.step = int(state["step"])
