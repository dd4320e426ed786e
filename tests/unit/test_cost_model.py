"""Cost-model tests: spec parsing, exact parameter counts, roofline regimes, memory, training and sync formulas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model_family import MODEL_FAMILIES  # noqa: E402
from parallel import sync_layout  # noqa: E402
from planner import calibration, cost_model, specs  # noqa: E402

H800 = specs.GPUType("H800", 80, 756, 2.0, 5.28, 200)
H20 = specs.GPUType("H20", 96, 148, 4.0, 1.85, 450)


def test_parameter_count_matches_transformers_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    cases = [
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            tie_word_embeddings=True,
        ),
        transformers.LlamaConfig(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            vocab_size=200,
            tie_word_embeddings=False,
        ),
        transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            tie_word_embeddings=False,
        ),
        transformers.MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=128,
            head_dim=16,
        ),
    ]
    for cfg in cases:
        d = tmp_path / cfg.model_type
        cfg.save_pretrained(d)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert specs.load_model_spec(d).params == sum(p.numel() for p in model.parameters()), cfg.model_type


def test_shipped_model_shapes():
    sizes = {
        "deepseek-r1-distill-qwen-1.5b": 1.777e9,
        "deepseek-r1-distill-qwen-7b": 7.616e9,
        "deepseek-r1-distill-qwen-14b": 14.770e9,
        "qwen2.5-0.5b": 0.494e9,
    }
    for name, n in sizes.items():
        assert specs.load_model_spec(name).params == pytest.approx(n, rel=1e-3)
        assert specs.load_model_spec(ROOT / "exp/models" / f"{name}.json").params == specs.load_model_spec(name).params


def test_bad_specs_name_the_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(specs.SpecError, match="num_attention_heads|num_hidden_layers|intermediate|vocab"):
        specs.load_model_spec(tmp_path)
    spec = {
        "gpu_types": {"X": {"hbm_gb": 1, "tflops": 1, "hbm_tbps": 1, "dollars_per_hour": 1, "intra_gbps": 1}},
        "machines": [{"gpu_type": "Y", "gpus": 2}],
    }
    with pytest.raises(specs.SpecError, match="gpu_type 'Y'"):
        specs.cluster_from_dict(spec)
    spec["machines"] = [{"gpu_type": "X", "gpus": 2, "count": 2}]
    with pytest.raises(specs.SpecError, match="inter_gbps lacks 'X-X'"):
        specs.cluster_from_dict(spec)
    del spec["gpu_types"]["X"]["tflops"]
    with pytest.raises(specs.SpecError, match="numeric"):
        specs.cluster_from_dict(spec)
    with pytest.raises(specs.SpecError, match="eta"):
        specs.Workload(eta=-1)
    with pytest.raises(specs.SpecError, match="precision"):
        specs.Workload(precision="int3")


def test_shipped_clusters_match_the_paper():
    c = specs.load_cluster(ROOT / "exp/clusters/h800_24.yaml")
    assert (c.n_gpus, c.dollars_per_hour()) == (24, pytest.approx(126.72))
    c = specs.load_cluster(ROOT / "exp/clusters/hetero_32.yaml")
    assert (c.n_gpus, c.dollars_per_hour()) == (32, pytest.approx(86.64))
    assert c.link_gbps(0, 1) == 1.5 and c.link_gbps(1, 2) == 5.0 and c.link_gbps(0, 0) == 200
    for n in (24, 40, 56):
        assert specs.load_cluster(ROOT / f"exp/clusters/hetero_{n}.yaml").n_gpus == n
    assert specs.load_cluster(ROOT / "exp/clusters/hetero_56.yaml").dollars_per_hour() <= 126.72
    assert specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", nproc=6).n_gpus == 6


def test_workload_quantiles_keep_the_mean():
    wl = specs.Workload.from_quantiles(2000, {0.5: 1200, 0.9: 5000, 0.99: 20000})
    assert wl.gen_mean == pytest.approx(2000)
    assert wl.decode_context > wl.prompt_len + wl.gen_mean / 2  # a long tail holds KV longer than the mean
    assert specs.Workload(gen_samples=[100.0]).decode_context == pytest.approx(512 + 50)


def test_decode_roofline_regimes():
    model = specs.load_model_spec("deepseek-r1-distill-qwen-7b")
    eff = specs.TypeEfficiency(mfu_train=0.4, mfu_infer=1.0, hbm_eff=1.0)
    # batch 1, no context: pure weight scan -> bytes / bandwidth exactly
    t = cost_model.decode_round_s(model, H800, eff, 1, 1, 1, 0.0, 2, 5.0)
    assert t == pytest.approx((model.layers * model.layer_params + model.head_params) * 2 / 2e12)
    # huge batch on a FLOP-poor GPU: compute-bound -> time linear in batch
    t1 = cost_model.decode_round_s(model, H20, eff, 1, 1, 2048, 0.0, 2, 5.0)
    t2 = cost_model.decode_round_s(model, H20, eff, 1, 1, 4096, 0.0, 2, 5.0)
    assert t2 == pytest.approx(2 * t1)
    # per-GPU weights shrink with TP, and H20's bandwidth makes its weight scan 2x faster than H800's
    assert cost_model.decode_round_s(model, H800, eff, 2, 1, 1, 0.0, 2, 5.0) < t
    assert cost_model.decode_round_s(model, H20, eff, 1, 1, 1, 0.0, 2, 5.0) == pytest.approx(t / 2)


def test_decode_round_is_bytes_over_bandwidth_plus_the_per_step_overhead():
    """Memory-bound decode: one step = decode_bytes_per_step / (hbm_tbps x hbm_eff) + decode_overhead_s; the default
    overhead 0 leaves the round time exactly as it was (no shipped plan changes)."""
    model = specs.load_model_spec("deepseek-r1-distill-qwen-7b")
    eff = specs.TypeEfficiency(mfu_infer=0.5, hbm_eff=0.6)
    for batch, context in ((1, 100.0), (16, 2000.0), (32, 4000.0)):
        t = cost_model.decode_round_s(model, H20, eff, 1, 1, batch, context, 2, 5.0)
        memory = cost_model.decode_bytes_per_step(model, batch, context, 2) / (H20.hbm_tbps * 1e12 * eff.hbm_eff)
        assert t == pytest.approx(memory, rel=1e-12)  # memory-bound on H20 at these batches
        slow = specs.TypeEfficiency(mfu_infer=0.5, hbm_eff=0.6, decode_overhead_s=0.004)
        assert cost_model.decode_round_s(model, H20, slow, 1, 1, batch, context, 2, 5.0) == t + 0.004
        zero = specs.TypeEfficiency(mfu_infer=0.5, hbm_eff=0.6, decode_overhead_s=0.0)
        assert cost_model.decode_round_s(model, H20, zero, 1, 1, batch, context, 2, 5.0) == t
    # an efficiency YAML written before the field existed still loads, with overhead 0
    old = specs.Efficiency.from_dict({"per_type": {"H20": {"mfu_train": 0.3, "mfu_infer": 0.5, "hbm_eff": 0.6}}})
    assert old.of("H20").decode_overhead_s == 0.0


def _generator(max_batch: int, interrupt_mode: str = "recompute"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from generator import Generator

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    return model, Generator(model, max_batch_size=max_batch, max_seq_len=64, interrupt_mode=interrupt_mode)


@pytest.mark.parametrize("groups,samples,prompt_len", [(3, 4, 7), (2, 8, 12), (5, 1, 3)])
def test_prompt_prefill_is_priced_as_the_generator_prefills_it(groups, samples, prompt_len):
    """A step's prompt prefill is each GRPO group's prompt once, but its last token (cost_model.prompt_prefill_tokens): the
    tokens generator.Generator prefills for a step's groups, its samples sharing the prompt's K/V, exactly."""
    from generator import SamplingParams

    _, gen = _generator(max_batch=samples)
    for g in range(groups):
        prompt = [1 + (g * 7 + i) % 60 for i in range(prompt_len)]
        for s in range(samples):
            gen.add_request((g, s), prompt, SamplingParams(temperature=1.0, max_new_tokens=5, seed=g * 100 + s))
    while gen.num_unfinished():
        gen.step()
    wl = specs.Workload(prompts_per_step=groups, samples_per_prompt=samples, prompt_len=prompt_len, gen_samples=[5.0])
    assert gen.stats.prefill_tokens == cost_model.prompt_prefill_tokens(wl)
    # the pre-sharing charge (every sample its whole prompt) is what the generator no longer does
    assert cost_model.prompt_prefill_tokens(wl) <= wl.batch * wl.prompt_len / samples


@pytest.mark.parametrize("running,prompt_len,generated", [(4, 7, 3), (8, 12, 10), (1, 2, 1)])
def test_a_weight_update_recomputes_what_the_cost_model_charges(running, prompt_len, generated):
    """cost_model.recompute_tokens: a weight update in "recompute" mode re-prefills every running sequence's context but its
    last token -- generator.Generator's recompute_tokens exactly, for sequences `generated` tokens in (the mean a
    running sequence holds of g-token answers, Workload.decode_context, is g / 2 in: g = 2 * generated); none in
    "keep" mode, and none at eta = 0, where the step waits for every sequence before the update."""
    from generator import SamplingParams

    for mode in ("recompute", "keep"):
        model, gen = _generator(max_batch=running, interrupt_mode=mode)
        for s in range(running):
            prompt = [1 + (s + i) % 60 for i in range(prompt_len)]
            gen.add_request(s, prompt, SamplingParams(temperature=1.0, max_new_tokens=2 * generated + 5, seed=s))
        for _ in range(generated):
            gen.step()
        gen.update_weights({k: v.clone() for k, v in model.state_dict().items()}, version=1)
        wl = specs.Workload(
            prompt_len=prompt_len, gen_samples=[2.0 * generated], eta=1, kv_recompute=mode == "recompute"
        )
        assert gen.stats.recompute_tokens == cost_model.recompute_tokens(wl, running)
    assert (
        cost_model.recompute_tokens(
            specs.Workload(prompt_len=prompt_len, gen_samples=[2.0 * generated], eta=0), running
        )
        == 0
    )


def test_the_recompute_is_charged_as_far_as_the_rollout_overruns_the_train_step():
    """A rollout side done with its batch before the train step sits idle at the staleness bound when the update
    comes (no recompute); one still busy when the step ends (the bottleneck) recomputes all its running sequences;
    in between, rollout_seconds is continuous and falls as the train step grows."""
    model = specs.load_model_spec("deepseek-r1-distill-qwen-7b")
    wl = specs.Workload(prompts_per_step=64, samples_per_prompt=8, prompt_len=512, gen_samples=[2000.0], eta=2)
    args = (model, wl, 5000.0, 100.0, 50.0)
    base = cost_model.rollout_seconds(*args)  # nothing running
    full = cost_model.recompute_tokens(wl, 256) * 2 * model.params / 100e12
    assert base == pytest.approx(
        wl.batch * 2000 / 5000 + cost_model.prompt_prefill_tokens(wl) * 2 * model.params / 100e12
    )
    assert cost_model.rollout_seconds(*args, 256, 0.0) == pytest.approx(base + full)  # the rollout is the bottleneck
    assert cost_model.rollout_seconds(*args, 256, base + full) == pytest.approx(
        base
    )  # done, recompute included, in time
    times = [cost_model.rollout_seconds(*args, 256, t) for t in [base + full * f for f in (0.0, 0.25, 0.5, 0.75, 1.0)]]
    assert all(a > b for a, b in zip(times, times[1:])) and times[0] == pytest.approx(base + full)
    assert cost_model.rollout_seconds(
        model, specs.Workload(**{**wl.to_dict(), "eta": 0}), 5000.0, 100.0, 50.0, 256, 0.0
    ) == (cost_model.rollout_seconds(model, specs.Workload(**{**wl.to_dict(), "eta": 0}), 5000.0, 100.0, 50.0))
    with pytest.raises(specs.SpecError, match="kv_recompute"):
        specs.Workload(kv_recompute="yes")


def test_replica_memory_limits_batch_and_feasibility():
    wl = specs.Workload(gen_samples=[4000], max_batch=10**6)
    eff = specs.Efficiency()
    m14 = specs.load_model_spec("deepseek-r1-distill-qwen-14b")
    small = specs.GPUType("S", 24, 100, 1.0, 1.0, 50)
    assert cost_model.replica_cost(m14, small, 1, 1, wl, eff, 5.0) is None  # 29.5 GB of weights > 24 GB
    # a TP rank holds the whole model once while loading it (train.py's load_policy), then slices it: no help here
    assert cost_model.replica_cost(m14, small, 2, 1, wl, eff, 5.0) is None
    medium = specs.GPUType("M", 40, 100, 1.0, 1.0, 50)  # the whole model loads; its halves leave room for KV
    assert cost_model.replica_cost(m14, medium, 2, 1, wl, eff, 5.0) is not None
    assert cost_model.replica_memory_batch(m14, medium, 2, 1, wl, 0.9) > 5 * cost_model.replica_memory_batch(
        m14, medium, 1, 1, wl, 0.9
    )
    b80 = cost_model.replica_memory_batch(m14, H800, 1, 1, wl, 0.9)
    b96 = cost_model.replica_memory_batch(m14, H20, 1, 1, wl, 0.9)
    assert 0 < b80 < b96
    assert cost_model.replica_memory_batch(m14, H800, 2, 1, wl, 0.9) > 2 * b80  # TP frees weight memory too


def test_train_step_scales_with_efficiency_and_counts_the_bubble():
    model = specs.load_model_spec("qwen2.5-0.5b")
    wl = specs.Workload(
        prompts_per_step=16, samples_per_prompt=4, gen_samples=[1000], ppo_minibatches=1, microbatch_tokens=4096
    )
    types = {"H800": H800}

    def step(mfu: float, pp: int, dp: int = 1) -> float:
        eff = specs.Efficiency(per_type={"H800": specs.TypeEfficiency(mfu_train=mfu)})
        stages = [
            cost_model.StageSpec("H800", l, (0,), 200, 200, 200) for l in cost_model.layer_counts(model.layers, pp)
        ]
        return cost_model.train_step_seconds(model, stages, dp, 1, types, wl, eff)

    assert step(0.2, 1) / step(0.4, 1) == pytest.approx(2, rel=0.05)
    assert step(0.4, 1, dp=2) < 0.6 * step(0.4, 1)
    # 2 equal-ish stages: pipeline time ~ (m + 1) half-stage times, i.e. more than half the 1-stage time
    m = -(-wl.tokens_per_step // wl.microbatch_tokens)
    assert step(0.4, 2) > step(0.4, 1) / 2 * (m + 1) / m * 0.95


def test_a_pipeline_stage_works_its_micro_batches_and_idles_the_bubble():
    """Per stage, train_step_times' busy time is its m micro-batches, its optimizer and its fixed work; the step is
    the 1F1B pipeline, sum_k t_k + (m - 1) max_k t_k, so a stage idles the rest. One stage has no bubble."""
    model = specs.model_from_config(  # 4 layers, untied: two stages of 2 layers, the last with the LM head
        {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False}, "m")  # fmt: skip
    wl = specs.Workload(prompts_per_step=8, samples_per_prompt=1, prompt_len=0, gen_samples=[1000.0], ppo_minibatches=2,
                     microbatch_tokens=1000, train_passes=3.0, precision="fp32")  # fmt: skip
    te = specs.TypeEfficiency(mfu_train=0.4, train_overhead_s=0.01)
    eff, types = specs.Efficiency(per_type={"H800": te}), {"H800": H800}
    one = [cost_model.StageSpec("H800", 4, (0,), 1e9, 1e9, 0.0)]
    seconds, busy = cost_model.train_step_times(model, one, 1, 1, types, wl, eff)
    assert busy == [pytest.approx(seconds)]
    two = [cost_model.StageSpec("H800", 2, (0,), 1e9, 1e9, 100.0), cost_model.StageSpec("H800", 2, (0,), 1e9, 1e9, 0.0)]
    seconds, busy = cost_model.train_step_times(model, two, 1, 1, types, wl, eff)
    # by hand: a minibatch of 4 sequences of 1000 tokens runs as m = 4 micro-batches of 1000 tokens
    m, mb, rate = 4, 1000.0, H800.tflops * 1e12 * 0.4
    flops = 3 * mb * 2 * model.layer_flops_per_token(wl.decode_context)
    t = [
        flops / rate + 3 * (cost_model.LINK_LATENCY_S + mb * 256 * 4 / 100e9),
        (flops + 3 * mb * 2 * model.head_params) / rate,
    ]
    params = [2 * model.layer_params, 2 * model.layer_params + model.head_params]
    own = [p * 30 / (H800.hbm_tbps * 1e12 * te.hbm_eff) + 0.01 for p in params]  # optimizer (dp 1) + fixed
    assert busy == [pytest.approx(2 * (m * t[k] + own[k]), rel=1e-9) for k in (0, 1)]
    assert seconds == pytest.approx(2 * (sum(t) + (m - 1) * max(t) + max(own)), rel=1e-9)
    assert all(0 < seconds - b < seconds / 2 for b in busy)  # each stage idles part of the step, not most of it


@pytest.mark.parametrize("dp, pp", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)])
def test_train_step_charges_the_micro_batches_the_runtime_packs(dp, pp):
    """A DP rank's share S of a minibatch runs as m = max(stages, ceil(S / microbatch_tokens)) micro-batches of
    S / m tokens (parallel/trainer.py), so a step of tokens just past a multiple of the budget costs its FLOPs, not
    an extra full micro-batch: the FLOP part is the same as one of exactly k full micro-batches per rank scaled by
    S / (k mb)."""
    from parallel.packing import dynamic_microbatches

    model = specs.load_model_spec("qwen2.5-0.5b")
    types = {"H800": H800}
    eff = specs.Efficiency(per_type={"H800": specs.TypeEfficiency(mfu_train=0.4)})
    stages = [cost_model.StageSpec("H800", l, (0,), 1e9, 1e9, 1e9 if k < pp - 1 else 0.0)
              for k, l in enumerate(cost_model.layer_counts(model.layers, pp))]  # fmt: skip

    def step(samples: int, gen: float) -> float:
        wl = specs.Workload(prompts_per_step=samples, samples_per_prompt=1, prompt_len=0, gen_samples=[gen],
                         ppo_minibatches=1, microbatch_tokens=4096, train_passes=3.0)  # fmt: skip
        no_fixed = cost_model.train_step_seconds(model, stages, dp, 1, types, wl, eff)
        zero = specs.Workload(**{**wl.to_dict(), "gen_samples": [1.0]})  # the fixed terms (and a token a sequence)
        return no_fixed - cost_model.train_step_seconds(model, stages, dp, 1, types, zero, eff)

    # 2 sequences per rank of 2100 tokens: the runtime packs them into 2 micro-batches (4200 > 4096)
    share = [2100, 2100]
    packs = dynamic_microbatches(share, 4096, pp)
    assert len(packs) == max(pp, 2)
    exact = step(2 * dp, 2048.0)  # 2 full-ish micro-batches of 4096 per rank
    assert step(2 * dp, 2100.0) == pytest.approx(exact * 2100 / 2048, rel=0.02)


@pytest.mark.parametrize("kind", sorted(MODEL_FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_param_table_is_the_hf_state_dict(kind, tied):
    """What the planner prices is what HF holds, for every family hexrl runs: names, sizes and order (a tied model
    sends no lm_head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        kind, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    want = [(n, t.numel()) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]
    spec = specs.model_from_config(config.to_dict())
    assert sync_layout.hf_param_table(spec) == want
    assert sum(n for _, n in want) == spec.params
    assert specs.model_from_config(spec.to_config()) == spec  # the plan's copy of the model reads back the same


def test_a_family_outside_the_list_is_one_error_naming_it():
    with pytest.raises(specs.SpecError, match="'gpt2' is not supported .*llama, qwen2, qwen3, mistral"):
        specs.model_from_config({**specs.load_model_spec("qwen2.5-0.5b").to_config(), "model_type": "gpt2"})


def test_sync_buckets_cover_every_tensor_once_per_stage_within_the_size():
    m = specs.load_model_spec("deepseek-r1-distill-qwen-7b")
    table = sync_layout.hf_param_table(m)
    stages = [(0, 10), (10, 20), (20, m.layers)]
    buckets = sync_layout.sync_buckets(table, stages, 2, 64 * 2**20)
    assert [n for b in buckets for n in b.names] == [n for n, _ in table]  # every tensor once, in order
    assert [b.stage for b in buckets] == sorted(b.stage for b in buckets)
    for b in buckets:
        assert all(sync_layout.param_stage(n, stages) == b.stage for n in b.names)
        assert b.payload_bytes <= 64 * 2**20 or len(b.names) == 1  # only a tensor larger than a bucket exceeds it
        assert b.wire_bytes % 8 == 0 and b.payload_bytes + 8 <= b.wire_bytes < b.payload_bytes + 16
    assert sync_layout.sync_bytes_sent(buckets, 3) == 3 * sum(b.wire_bytes for b in buckets)
    assert sum(b.payload_bytes for b in buckets) == 2 * m.params


def test_sync_time_follows_the_schedule_and_step_formula():
    eff = specs.Efficiency(link_eff=0.25, sync_latency_s=2.0)
    wl = specs.Workload()
    m = specs.load_model_spec("deepseek-r1-distill-qwen-1.5b")
    buckets = sync_layout.sync_buckets(sync_layout.hf_param_table(m), [(0, 14), (14, m.layers)], 2, 64 * 2**20)
    total = sum(b.wire_bytes for b in buckets)
    stage_bytes = [sum(b.wire_bytes for b in buckets if b.stage == s) for s in (0, 1)]
    cross, inside = 5.0, 50.0

    def gbps(a, b):
        return inside if a == b else cross

    one_owner = [[9], [9]]  # both stages' owners on train machine 9, one DP replica
    one = cost_model.sync_seconds(buckets, {0: 1}, one_owner, gbps, eff)  # the relay receives both stages in turn
    assert one == pytest.approx(2.0 + total / (0.25 * cross * 1e9))
    # a relay with 3 machine-mates: it forwards each bucket once it has it, holding 2 at most, so its third receive
    # waits for the forward of the first bucket (the 466.7 MB embedding), and the mates hold the version one forward
    # of the last bucket (the LM head) after the relay received it
    first, second, last = buckets[0].wire_bytes, buckets[1].wire_bytes, buckets[-1].wire_bytes
    stall = 3 * first / (0.25 * inside * 1e9) - second / (0.25 * cross * 1e9)
    send, ready = cost_model.sync_times(buckets, {0: 4}, one_owner, gbps, eff)
    assert stall > 0 and send == pytest.approx(one + stall)
    assert ready == pytest.approx(send + 3 * last / (0.25 * inside * 1e9))
    assert cost_model.sync_seconds(buckets, {0: 4}, one_owner, gbps, eff) == ready
    # a slow local link: the forwards are the bottleneck and run back to back after the first receive
    slow_inside = cost_model.sync_seconds(buckets, {0: 4}, one_owner, lambda a, b: 1.0 if a == b else cross, eff)
    assert slow_inside == pytest.approx(2.0 + first / (0.25 * cross * 1e9) + 3 * total / (0.25 * 1e9))
    # two rollout machines: each owner sends its stage twice, each relay still receives everything once ...
    two = cost_model.sync_seconds(buckets, {0: 1, 1: 1}, one_owner, gbps, eff)
    assert two == pytest.approx(2.0 + max(total, 2 * max(stage_bytes)) / (0.25 * cross * 1e9))
    # ... unless two DP replicas share the fan-out: each machine takes each stage from a different replica
    assert sync_layout.assign_senders([[9, 8], [9, 8]], [0, 1], gbps) == {(0, 0): 0, (1, 0): 0, (0, 1): 1, (1, 1): 1}
    assert cost_model.sync_seconds(buckets, {0: 1, 1: 1}, [[9, 8], [9, 8]], gbps, eff) == pytest.approx(one)
    # the best-connected replica wins over the least loaded one
    assert sync_layout.assign_senders([[9, 0]], [0, 1], gbps) == {(0, 0): 1, (0, 1): 0}
    assert cost_model.step_seconds(10, 7, 1, wl) == 11
    assert cost_model.step_seconds(10, 7, 1, specs.Workload(eta=0)) == 18


def test_a_machine_mate_holds_a_one_bucket_version_two_hops_after_the_sync_starts():
    """The replicas take the version later than the owners finish sending: the trainer pauses for its sends, the
    rollout side (and an eta = 0 step) until every replica holds it."""
    eff = specs.Efficiency(link_eff=0.5, sync_latency_s=0.01)
    bucket = sync_layout.SyncBucket(0, ("w",), (10**8,), 2)  # 200 MB: one hop is 0.2 s at 0.5 x 2 GB/s
    hop = bucket.wire_bytes / (0.5 * 2e9)
    assert cost_model.sync_times([bucket], {0: 1}, [[0]], lambda a, b: 2.0, eff) == pytest.approx(
        (0.01 + hop, 0.01 + hop)
    )
    send, ready = cost_model.sync_times([bucket], {0: 2}, [[0]], lambda a, b: 2.0, eff)
    assert send == pytest.approx(0.01 + hop) and ready == pytest.approx(0.01 + 2 * hop)
    # split in two buckets the forward of the first overlaps the receive of the second: one half-hop later, not one
    halves = [sync_layout.SyncBucket(0, ("a",), (5 * 10**7,), 2), sync_layout.SyncBucket(0, ("b",), (5 * 10**7,), 2)]
    send, ready = cost_model.sync_times(halves, {0: 2}, [[0]], lambda a, b: 2.0, eff)
    half = halves[0].wire_bytes / (0.5 * 2e9)
    assert send == pytest.approx(0.01 + 2 * half) and ready == pytest.approx(0.01 + 3 * half)
    # a step with eta >= 1: the rollout side pays the sync until its replicas hold it, the train side its sends
    wl = specs.Workload(eta=1)
    assert cost_model.step_seconds(10, 7, 1.5, wl, sync_send_s=0.5) == 11.5
    assert cost_model.step_seconds(5, 7, 1.5, wl, sync_send_s=0.5) == 7.5
    assert cost_model.step_seconds(5, 7, 1.5, specs.Workload(eta=0), sync_send_s=0.5) == 13.5


def test_cpu_profile_is_positive():
    # its run time against the budget is measured by exp/bench_schedule.py
    prof = calibration.profile_cpu(1.0)
    assert prof["tflops"] > 0 and prof["hbm_tbps"] > 0
