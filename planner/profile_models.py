"""The random models, batches and trainers a device profile times (planner/device_profile.py) and the CPU bench's
co-load peers run beside it (cpu_bench/co_load.py): random HF Llamas, random trajectories, the profiled Trainer."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from config import TrainConfig
from parallel.groups import build_groups
from parallel.trainer import Trainer
from plan import make_train_plan
from planner import specs


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def random_llama(h: int, i: int, layers: int, heads: int, kv: int, vocab: int):
    """A random HF Llama of these dimensions (seeded: every process that builds it holds the same weights) and its
    cost-model spec."""

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), specs.model_from_config(cfg.to_dict(), f"llama-h{h}-l{layers}")


def random_trajectories(vocab: int, n: int, prompt: int, response: int, seed: int) -> list:
    """n random trajectories of these lengths (seeded: every rank of a TP step builds the same batch)."""

    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt + response,), generator=rng).tolist()
        out.append(
            SimpleNamespace(
                prompt_id=i,
                sample_idx=0,
                prompt_ids=ids[:prompt],
                response_ids=ids[prompt:],
                behav_logprobs=(-9.0 + 0.1 * torch.randn(response, generator=rng)).tolist(),
                versions=[0] * response,
                reward=0.0,
                advantage=float(torch.randn((), generator=rng)),
            )
        )
    return out


PROFILE_MINIBATCHES = 2  # PPO minibatches of a profiled train step: the proximal recompute runs, as in RL runs


def profiled_trainer(hf, spec, tp: int, micro_batch_tokens: int, device, dtype, dp: int = 1):
    """The Trainer a profile times: one stage of every layer over dp x tp ranks (the world), 2 PPO minibatches (so the
    proximal log-prob recompute runs: the 4 passes specs.Workload().train_passes counts); over DP without FSDP, as the
    CPU recipes train (exp/configs/cpu_demo.yaml: train.shard_state false)."""

    groups = build_groups(make_train_plan(dp, tp, 1, [(0, spec.layers)]))
    cfg = TrainConfig(
        lr=1e-6,
        ppo_minibatches=PROFILE_MINIBATCHES,
        micro_batch_tokens=micro_batch_tokens,
        min_microbatches=1,
        shard_state=False,
    )
    return Trainer(hf, groups, cfg, device, compute_dtype=dtype)
