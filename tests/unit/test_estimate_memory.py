"""exp/estimate_memory.py: its acceptance rule, the ranks it stands for, and the planner's memory model against the
estimator (the estimator against peaks measured on real gloo ranks: tests/dist/test_measured_ranks.py)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "exp"))

import schedule  # noqa: E402
from planner import cost_model, memory, specs  # noqa: E402

within = memory.validation_ok  # within 15% of the measured lower bound, not above the upper bound by more than that


def test_within_rejects_an_estimate_that_misses_the_activations():
    row = {"measured_low": 100.0, "measured_high": 110.0, "estimated": 80.0}
    assert not within(row)
    assert within({**row, "estimated": 105.0}) and not within({**row, "estimated": 130.0})


def _plan(cluster: str, model: str, **kw) -> dict:
    wl = specs.Workload.from_quantiles(
        1500, {0.5: 1000, 0.9: 3500, 0.99: 7000}, prompts_per_step=64, samples_per_prompt=16, prompt_len=200,
        ppo_minibatches=4, **kw
    )  # fmt: skip
    return schedule.plan(specs.load_cluster(ROOT / f"exp/clusters/{cluster}.yaml"), specs.load_model_spec(model), wl)


def test_distinct_ranks_stand_for_every_working_rank_once():
    plan = _plan("hetero_24", "deepseek-r1-distill-qwen-7b", microbatch_tokens=16384, max_batch=64)
    entries = memory.distinct_ranks(plan)
    covered = sorted(r for e in entries for r in e["ranks"])
    working = sorted(r["rank"] for r in plan["ranks"] if not r.get("idle"))
    assert covered == working
    for e in entries:
        assert e["rank"] in e["ranks"]
        entry = plan["ranks"][e["rank"]]
        assert entry["role"] == e["role"] and entry["gpu_type"] == e["gpu_type"]
        if e["role"] == "train":
            assert entry["dp"] == 0  # DP rank 0 holds the largest FSDP shard
    stages = plan["train"]["pp"] * (2 if plan["train"]["tp"] > 1 else 1)
    assert sum(e["role"] == "train" for e in entries) == stages


def test_planner_memory_model_agrees_with_the_estimator():
    """cost_model's per-rank bytes (what schedule.py checks) against the estimator on a shipped-like case: Qwen2.5-0.5B
    widths (2 layers keep it fast), bf16, activation checkpointing, 4096-token micro-batches, under FSDP (dp 2: the
    LM head's backward peaks) and 1F1B without FSDP (pp 2: the embedding's fp64 grad norm, then the LM head)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from config import Config
    from plan import make_train_plan

    fields = json.loads((ROOT / "exp/models/qwen2.5-0.5b.json").read_text())
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    fields["num_hidden_layers"] = 2
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg = Config()
    cfg.model.dtype, cfg.data.max_prompt_tokens, cfg.dist.weight_bucket_mb = "bfloat16", 512, 64.0
    r, t = cfg.rollout, cfg.train
    r.samples_per_prompt, r.max_new_tokens, r.max_seq_len, r.max_batch_size = 8, 1024, 1536, 8
    t.prompts_per_step, t.ppo_minibatches, t.micro_batch_tokens, t.activation_checkpointing = 4, 2, 4096, True
    spec = specs.model_from_config(hf.to_dict())
    prompt, response, _ = memory.batch_shape(cfg)
    wl = specs.Workload(prompts_per_step=4, samples_per_prompt=8, prompt_len=prompt, gen_samples=[response],
                     ppo_minibatches=2, microbatch_tokens=4096, max_batch=8)  # fmt: skip
    compared = []
    for (dp, tp, pp), stages, ranks in (((2, 1, 1), [(0, 2)], (0, 2)), ((1, 1, 2), [(0, 1), (1, 2)], (0, 1))):
        plan = make_train_plan(dp, tp, pp, stages, world_size=dp * tp * pp + 1)
        for rank in ranks:
            memory.init_fake(plan["world_size"], rank)
            try:
                est = memory.estimate_rank(cfg, plan, rank, 80e9, hf_cfg=hf)
            finally:
                dist.destroy_process_group()
            if est["role"] == "train":
                k = rank // (dp * tp)
                a, b = stages[k]
                ours = cost_model.train_memory_parts(spec, b - a, k == pp - 1, k == 0, dp, tp, k, pp, wl)
            else:
                pool = r.max_batch_size * r.max_seq_len  # the Generator's pool without kv_cache_* keys
                ours = cost_model.replica_memory_parts(
                    spec, 1, pool, r.max_batch_size, wl, cfg.dist.weight_bucket_mb * 2**20
                )
            compared.append((dp, tp, pp, rank, est["role"], est["peak_bytes"], ours["peak_bytes"]))
    bad = [c for c in compared if abs(c[6] / c[5] - 1) > 0.15]
    assert not bad, compared
    assert {c[4] for c in compared} == {"train", "rollout"}
