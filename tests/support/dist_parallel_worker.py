"""torchrun worker: the parallel trainer against a 1-process reference (plain HF forward + decoupled_ppo_loss).

    torchrun --nproc_per_node=4 tests/support/dist_parallel_worker.py --layouts "2,1,1:2+2;1,1,2:3+1" --models qwen2,llama,qwen3,mistral
        [--vocab-parallel-out DIR]

For each model and each layout (dp,tp,pp:layers per stage), ranks 0..dp*tp*pp-1 train, the rest are rollout ranks
(they only take part in build_groups). Checked on every train rank, against the same reference computed locally:
  - gathered full state dict (train head) == reference parameters, bitwise, HF names and shapes;
  - loss and every local parameter shard's gradient after one forward/backward, within 1e-5 relative;
  - parameters after one train_step of 3 PPO minibatches (3 AdamW steps, clipping) within 1e-5 relative.
Prints one "RESULT" line per check; exit code 1 if any check failed on this rank. With --vocab-parallel-out, ranks 0
and 1 also compute vocab-parallel log-probs / entropy (parallel.ppo) over their half of a vocabulary each, plain and
chunked over tokens, against the full-vocab version, and save the largest differences (values and gradients) to
DIR/<rank>.pt for the test to judge.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import traceback
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from config import TrainConfig  # noqa: E402
from model_family import slice_shard  # noqa: E402
from parallel.groups import build_groups  # noqa: E402
from parallel.ppo import (  # noqa: E402
    aggregation_weights,
    chunked_over_tokens,
    decoupled_ppo_loss,
    k3_kl,
    token_logprobs_and_entropy,
    vocab_parallel_logprobs_and_entropy,
)
from parallel.trainer import Trainer  # noqa: E402
from plan import make_train_plan  # noqa: E402

torch.set_num_threads(1)
TOL = 1e-5


@dataclass
class Traj:
    prompt_id: int
    sample_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    reward: float
    advantage: float = 0.0
    finish_reason: str = "stop"


def tiny_model(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
    )  # larger than HF's 0.02 so the logits are far from uniform
    torch.manual_seed(0)
    if kind == "qwen2":  # tied embeddings, q/k/v bias
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "llama":  # GQA, untied
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    elif kind == "qwen3":  # per-head q/k norms (their gradients sum over TP), explicit head_dim, tied
        cfg = Qwen3Config(**common, head_dim=8, tie_word_embeddings=True)
    elif kind == "mistral":  # a sliding window shorter than the longer sequences
        cfg = MistralConfig(**common, sliding_window=5, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).float()
    # HF initialises biases to 0 and norms to 1; perturb them so their gradients and updates are really tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    return model


def seq_logprobs(model, tr: Traj, temperature: float) -> torch.Tensor:
    ids = torch.tensor(tr.prompt_ids + tr.response_ids)[None]
    logits = model(input_ids=ids).logits[0]
    p = len(tr.prompt_ids)
    return token_logprobs_and_entropy(logits[p - 1 : -1], torch.tensor(tr.response_ids), temperature)[0]


def make_trajectories(model, n: int, temperature: float) -> list[Traj]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        p, r = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(0, 96, (p + r,), generator=g).tolist()
        tr = Traj(i, 0, ids[:p], ids[p:], [], [0] * r, 0.0, float(torch.randn((), generator=g)))
        with torch.no_grad():
            lp = seq_logprobs(model, tr, temperature)
        tr.behav_logprobs = (lp + 0.3 * torch.randn(r, generator=g)).tolist()  # stale behaviour policy
        out.append(tr)
    return out


TEMPERATURE = 0.9  # the rollout temperature the trajectories were sampled at


def trainer_config(**overrides) -> TrainConfig:
    """The `train` section these tests train with: no importance-weight cap, Adam's textbook betas, chunked
    log-probs and per-layer activation checkpointing unless set."""
    # log-probs in chunks of 7 tokens: every micro-batch (up to 24 tokens) is split, unevenly
    return TrainConfig(
        **{
            "betas": [0.9, 0.999],
            "behav_imp_weight_cap": 0.0,
            "logprob_chunk_tokens": 7,
            "activation_checkpointing": True,
            **overrides,
        }
    )


def reference_minibatch_loss(model, trajs, prox, cfg: TrainConfig, temperature: float, ref=None) -> torch.Tensor:
    """One sequence at a time through a plain HF forward: the correction sees each sequence alone, the
    aggregation weights come from the whole minibatch; `ref`: each sequence's log-probs under the frozen
    reference (the KL term, train.kl_coef)."""
    weights = aggregation_weights([len(t.response_ids) for t in trajs], cfg.loss_aggregation)
    loss = 0.0
    for j, (tr, px, wt) in enumerate(zip(trajs, prox, weights)):
        lp = seq_logprobs(model, tr, temperature)
        r = len(tr.response_ids)
        loss = (
            loss
            + decoupled_ppo_loss(
                lp,
                px,
                torch.tensor(tr.behav_logprobs),
                torch.full((r,), tr.advantage),
                torch.ones(r, dtype=torch.bool),
                cfg.clip_eps,
                cfg.behav_imp_weight_cap,
                correction=cfg.behav_correction,
                bounds=tuple(cfg.behav_correction_bounds),
                seq_index=torch.zeros(r, dtype=torch.long),
                token_weight=wt,
            )[0]
        )
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * (k3_kl(lp, ref[j], torch.ones(r, dtype=torch.bool)) * wt).sum()
    return loss


def reference(model, trajs, cfg: TrainConfig, temperature: float = TEMPERATURE):
    """-> (loss, grads) of the whole batch; (losses, params) after a train_step with cfg.ppo_minibatches updates"""
    model = copy.deepcopy(model)
    with torch.no_grad():
        prox = [seq_logprobs(model, t, temperature) for t in trajs]
    ref = prox  # the frozen reference is the initial model
    loss = reference_minibatch_loss(model, trajs, prox, cfg, temperature, ref)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    k = cfg.ppo_minibatches
    bounds = [round(j * len(trajs) / k) for j in range(k + 1)]
    losses = []
    for j in range(k):
        sl = slice(bounds[j], bounds[j + 1])
        mb_loss = reference_minibatch_loss(model, trajs[sl], prox[sl], cfg, temperature, ref[sl])
        mb_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mb_loss.item())
    return loss.item(), grads, losses, {n: t.clone() for n, t in model.state_dict().items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """relative error of a tensor: ||a - b|| / ||b|| (Frobenius)"""
    return ((a - b).double().norm() / b.double().norm().clamp_min(1e-30)).item()


def vocab_parallel_errors(rank: int, world: int, group) -> dict:
    """This rank's shard (of `world`) of vocab-parallel log-probs and entropy over `group`, plain and chunked over
    tokens, against the full-vocab version: the largest differences of the values and of the logits' gradients."""
    g = torch.Generator().manual_seed(0)
    vocab, temperature = 10, 0.7
    logits = torch.randn(3, 5, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    coef_lp, coef_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    ref = logits.clone().requires_grad_()
    lp_ref, ent_ref = token_logprobs_and_entropy(ref, targets, temperature)
    ((lp_ref * coef_lp).sum() + (ent_ref * coef_ent).sum()).backward()

    shard = vocab // world
    local = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_and_entropy(local, targets, rank * shard, group, temperature)
    ((lp * coef_lp).sum() + (ent * coef_ent).sum()).backward()

    def vocab_parallel(x, t):
        return vocab_parallel_logprobs_and_entropy(x, t, rank * shard, group, temperature)

    chunked = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
    lp_c, ent_c = chunked_over_tokens(vocab_parallel, chunked, targets, 2)  # 5 tokens: chunks of 2, 2, 1
    ((lp_c * coef_lp).sum() + (ent_c * coef_ent).sum()).backward()
    return {
        "lp": (lp - lp_ref).abs().max().item(),
        "ent": (ent - ent_ref).abs().max().item(),
        "grad": (local.grad - ref.grad[..., rank * shard : (rank + 1) * shard]).abs().max().item(),
        "chunked": max((lp_c - lp).abs().max().item(), (ent_c - ent).abs().max().item()),
        "chunked_grad": (chunked.grad - local.grad).abs().max().item(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--models", default="qwen2,llama")
    ap.add_argument("--vocab-parallel-out")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.vocab_parallel_out:  # two ranks of the world, a group of their own
        pair = dist.new_group([0, 1])
        if rank < 2:
            errors = vocab_parallel_errors(rank, 2, pair)
            torch.save(errors, os.path.join(args.vocab_parallel_out, f"{rank}.pt"))
        dist.barrier()
    failures = 0

    def report(tag: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += 0 if ok else 1
        # one write() per line: ranks share the pipe, and a single small write is not interleaved
        sys.stdout.write(f"RESULT {'PASS' if ok else 'FAIL'} rank={rank} {tag} {detail}\n")
        sys.stdout.flush()

    for kind in args.models.split(","):
        model = tiny_model(kind)
        # Qwen2, Qwen3: AReaL's cap mask and token-mean; Llama, Mistral: a sequence-level geometric-mean mask (some
        # sequences of the stale behaviour policy fall outside it), GRPO's per-sequence token mean and a k3 KL to the
        # initial weights (a frozen reference sharded like the policy)
        variant = (
            {"behav_imp_weight_cap": 3.0}
            if kind in ("qwen2", "qwen3")
            else {
                "behav_correction": "mis-geo",
                "behav_correction_bounds": [0.85, 1.2],
                "loss_aggregation": "seq-mean-token-mean",
                "kl_coef": 0.1,
            }
        )
        cfg = trainer_config(
            lr=1e-3,
            weight_decay=0.01,
            eps=1e-6,
            grad_clip=1.0,
            clip_eps=0.2,
            recompute_prox_logprobs=True,
            ppo_minibatches=3,
            micro_batch_tokens=24,
            **variant,
        )
        trajs = make_trajectories(model, 10, TEMPERATURE)
        if cfg.behav_correction == "mis-geo":  # the mask must act, or this case could not fail
            low, high = (math.log(b) for b in cfg.behav_correction_bounds)
            with torch.no_grad():
                geo = [
                    float((seq_logprobs(model, t, TEMPERATURE) - torch.tensor(t.behav_logprobs)).mean()) for t in trajs
                ]
            dropped = sum(not low <= x <= high for x in geo)
            report(f"{kind} mis-geo drops some sequences", 0 < dropped < len(trajs), f"dropped={dropped}/{len(trajs)}")
        ref_loss, ref_grads, ref_losses, ref_after = reference(model, trajs, cfg)
        ref_init = {n: t.clone() for n, t in model.state_dict().items()}
        for layout in args.layouts.split(";"):
            dims, split, *mode = layout.split(":")  # mode "allreduce": DP without FSDP (train.shard_state=false)
            dp, tp, pp = (int(x) for x in dims.split(","))
            sizes = [int(x) for x in split.split("+")]
            stage_layers = [(sum(sizes[:s]), sum(sizes[: s + 1])) for s in range(pp)]
            groups = build_groups(make_train_plan(dp, tp, pp, stage_layers, world_size=world))
            tag = f"{kind} dp={dp} tp={tp} pp={pp} layers={split}" + (f" {mode[0]}" if mode else "")
            layout_cfg = dataclasses.replace(cfg, shard_state=not mode)
            if groups.is_train:
                # 1) gather == reference, bitwise
                trainer = Trainer(copy.deepcopy(model), groups, layout_cfg, "cpu", temperature=TEMPERATURE)
                full = trainer.gather_full_state_dict()
                if groups.is_train_head:
                    same = (
                        full is not None
                        and list(full) == list(ref_init)
                        and all(
                            full[n].shape == ref_init[n].shape and torch.equal(full[n], ref_init[n]) for n in ref_init
                        )
                    )
                    report(tag + " gather_bitwise", same, f"keys={len(full or {})}")
                # 2) loss and gradient shards after one forward/backward
                loss = trainer.compute_gradients(trajs)
                report(tag + " loss", abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{loss:.8g} vs {ref_loss:.8g}")
                worst, worst_name = 0.0, ""
                for name, p in trainer.params.items():
                    # a DTensor gradient (TP and/or FSDP shards) is compared whole; a plain one is this rank's TP slice
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    if dp > 1 and not mode and not isinstance(p.grad, DTensor):
                        report(tag + " grads_sharded_over_dp", False, f"{name}: a plain tensor, not a DP shard")
                    ref_name = (
                        "model.embed_tokens.weight" if (name == "lm_head.weight" and name not in ref_grads) else name
                    )
                    expected = ref_grads[ref_name]
                    if not isinstance(p.grad, DTensor):
                        expected = slice_shard(expected, trainer.stage.shard_specs[name], groups.tp_rank, tp)
                    if grad.shape != expected.shape:
                        report(tag + " grad_shape", False, f"{name} {tuple(grad.shape)} vs {tuple(expected.shape)}")
                        continue
                    e = rel_err(grad, expected)
                    if e > worst:
                        worst, worst_name = e, name
                report(tag + " grads", worst <= TOL, f"n={len(trainer.params)} max_rel={worst:.2e} ({worst_name})")
                # 3) three PPO minibatch updates from the initial weights
                trainer = Trainer(copy.deepcopy(model), groups, layout_cfg, "cpu", temperature=TEMPERATURE)
                metrics = trainer.train_step(trajs)
                ref_mean = sum(ref_losses) / len(ref_losses)
                report(
                    tag + " step_loss",
                    abs(metrics["loss"] - ref_mean) <= TOL * abs(ref_mean),
                    f"{metrics['loss']:.8g} vs {ref_mean:.8g} microbatches={metrics['num_microbatches']:.0f}",
                )
                full = trainer.gather_full_state_dict()
                if groups.is_train_head:
                    errs = {n: rel_err(full[n], ref_after[n]) for n in ref_after}
                    name = max(errs, key=errs.get)
                    report(tag + " params_after_3_steps", errs[name] <= TOL, f"max_rel={errs[name]:.2e} ({name})")
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
