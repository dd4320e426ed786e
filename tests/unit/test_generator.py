"""Tests for generator.Generator: exactness against HF, continuous batching, seeds, weight swaps, bad input."""

import dataclasses
import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from generator import Generator, SamplingParams
from sampler import counter_uniform, sample_tokens

torch.set_num_threads(1)

VOCAB = 96
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)


def make_model(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, **overrides))
    elif kind == "qwen2":  # q/k/v biases, tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True, **overrides))
    elif kind == "mistral":  # sliding window shorter than the sequences
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=5, **overrides))
    elif kind == "qwen3":  # q_norm / k_norm, explicit head_dim
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, **overrides))
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None  # HF must not stop on the config's default eos
    with torch.no_grad():  # random init has tiny logits; sharpen them so greedy has clear winners
        model.lm_head.weight.mul_(4.0)
    return model.eval()


PROMPTS = [[1, 5, 7, 9, 11], [3], [4, 8, 15, 16, 23, 42, 7], [10, 11], [12, 13, 14, 2], [30, 31, 32, 33, 34, 35]]


def full_forward_logprobs(model, prompt, tokens, temperature=1.0):
    """Log-prob of each generated token from one full forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def hf_greedy(model, prompt, max_new_tokens, stop=None):
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_matches_hf_generate_and_full_forward(kind):
    model = make_model(kind)
    gen = Generator(model, max_batch_size=3, max_seq_len=40)  # 6 prompts, 3 slots: slots get refilled
    free_run = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    stop = free_run[0].token_ids[4]  # a token greedy really emits, so at least one request stops on it
    outs = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop]))
    reasons = set()
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_ids == prompt
        assert out.token_ids == hf_greedy(model, prompt, 12, stop=stop)
        ref = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
        assert out.versions == [0] * len(out.token_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == stop else "length")
        assert out.finish_reason == "stop" or len(out.token_ids) == 12
        reasons.add(out.finish_reason)
    assert reasons == {"stop", "length"}
    assert gen.num_unfinished() == 0 and all(s is None for s in gen.slots)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_prefill_rows_ride_in_the_decode_forward_for_any_prefill_budget(kind):
    """New requests' prefill rows run in the same forward as the running slots' decode rows (the last chunk of
    a step), and chunks over the prefill token budget run as prefill-only forwards first. Budget 1 forces one
    request per chunk: many prefill-only forwards; 16384 forces none. Both equal HF greedy and the full forward
    (Mistral's window of 5 is shorter than the prompts, so the chunk attention's window mask is exercised)."""
    model = make_model(kind, seed=21)
    prompts = PROMPTS + [[40, 41, 42, 43, 44, 45, 46, 47, 48], [50, 51, 52]]
    results = {}
    for budget in (1, 16384):
        gen = Generator(model, max_batch_size=3, max_seq_len=40, max_prefill_tokens=budget)
        outs = gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=7))
        assert (gen.stats.prefill_forwards > 0) == (budget == 1)
        assert gen.stats.prefill_tokens == sum(len(p) - 1 for p in prompts)
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(model, prompt, 7)
            ref = full_forward_logprobs(model, prompt, out.token_ids)
            assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
        results[budget] = outs
    assert [o.token_ids for o in results[1]] == [o.token_ids for o in results[16384]]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_row_and_input_major_weights_give_the_same_outputs(kind):
    """On CPU each fused projection is stored [out, in] or [in, out], whichever MKL runs faster at decode size
    (weight_layout="auto"); both layouts must give the same tokens and log-probs, and the model's own
    parameters (views of the fused matrices) must still be the weights HF's forward uses."""
    outs = {}
    for layout in ("row", "input"):
        model = make_model(kind, seed=22)
        gen = Generator(model, max_batch_size=3, max_seq_len=40, weight_layout=layout)
        strides = {model.model.layers[0].mlp.down_proj.weight.stride()}
        assert strides == ({(COMMON["intermediate_size"], 1)} if layout == "row" else {(1, COMMON["hidden_size"])})
        outs[layout] = gen.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
        for prompt, out in zip(PROMPTS, outs[layout]):
            ref = full_forward_logprobs(model, prompt, out.token_ids)
            assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
    assert [o.token_ids for o in outs["row"]] == [o.token_ids for o in outs["input"]]
    diff = max(abs(a - b) for r, i in zip(outs["row"], outs["input"]) for a, b in zip(r.logprobs, i.logprobs))
    assert diff < 1e-5
    with pytest.raises(ValueError, match="weight_layout"):
        Generator(make_model(kind), weight_layout="column")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_bit_for_bit(dtype):
    """Our norm (F.rms_norm for fp32, HF's arithmetic written out for bf16) gives exactly HF's bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from model import rms_norm

    torch.manual_seed(23)
    for hidden, shape in [(64, (32, 1)), (256, (5, 37)), (896, (300,))]:
        norm = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(hidden))
        x = (3 * torch.randn(*shape, hidden)).to(dtype)
        assert torch.equal(rms_norm(norm, x), norm(x))


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_rope_table_and_per_step_rotary_match_hf(rope_type):
    """'linear' RoPE goes through the precomputed cos/sin table, 'dynamic' through the model's rotary module
    every step (its frequencies may depend on the length); both must equal HF."""
    model = make_model("llama", seed=5, rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0})
    gen = Generator(model, max_batch_size=3, max_seq_len=40)
    assert (gen.forward.rope_table is not None) == (rope_type == "linear")
    for prompt, out in zip(PROMPTS, gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))):
        assert out.token_ids == hf_greedy(model, prompt, 10)
        ref = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_greedy_matches_hf_left_padded_batch():
    """HF's own batched, left-padded generate (the way a user calls it) gives the same tokens."""
    model = make_model("llama", seed=3)
    outs = Generator(model, max_batch_size=2, max_seq_len=32).generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=8)
    )
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert [o.token_ids for o in outs] == ref[:, width:].tolist()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_sampled_logprobs_are_full_vocab_after_temperature(kind):
    model = make_model(kind, seed=1)
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=10, seed=5)
    outs = Generator(model, max_batch_size=4, max_seq_len=32).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = full_forward_logprobs(model, prompt, out.token_ids, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


# ----------------------------------------------------------------------------- continuous batching


def test_finished_request_frees_its_slot_at_once():
    gen = Generator(make_model("llama"), max_batch_size=2, max_seq_len=32)
    gen.add_request("short", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=2))
    gen.add_request("long", [4, 5], SamplingParams(temperature=0, max_new_tokens=6))
    gen.add_request("late", [6], SamplingParams(temperature=0, max_new_tokens=3))
    assert gen.num_unfinished() == 3
    assert gen.step() == [] and [r.request_id for r in gen.slots] == ["short", "long"]
    finished = gen.step()
    assert [o.request_id for o in finished] == ["short"] and gen.slots[0] is None
    gen.step()  # the waiting request takes the freed slot while "long" keeps decoding
    assert gen.slots[0].request_id == "late" and len(gen.slots[0].token_ids) == 1
    assert len(gen.slots[1].token_ids) == 3
    done = {}
    while gen.num_unfinished():
        done.update({o.request_id: o for o in gen.step()})
    assert len(done["late"].token_ids) == 3 and len(done["long"].token_ids) == 6
    assert gen.stats.generated_tokens == 2 + 6 + 3 and gen.stats.decode_steps == 6


def test_same_result_for_any_slot_count():
    model = make_model("qwen2", seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=9, seed=11)
    a = Generator(model, max_batch_size=1, max_seq_len=32).generate(PROMPTS, params)
    b = Generator(model, max_batch_size=5, max_seq_len=32).generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5


# ----------------------------------------------------------------------------- sampling and seeds


def test_seed_is_independent_of_batch_and_slot():
    model = make_model("llama", seed=4)
    target = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=1234)
    alone = Generator(model, max_batch_size=4, max_seq_len=32).generate([PROMPTS[2]], [target])[0]
    others = [SamplingParams(temperature=1.0, max_new_tokens=3 + i, seed=i) for i in range(4)]
    crowd = Generator(model, max_batch_size=3, max_seq_len=32).generate(PROMPTS[:4] + [PROMPTS[2]], others + [target])[
        4
    ]  # lands in a refilled slot mid-stream
    assert crowd.token_ids == alone.token_ids
    other_seed = Generator(model, max_batch_size=4, max_seq_len=32).generate(
        [PROMPTS[2]], [SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=99)]
    )[0]
    assert other_seed.token_ids != alone.token_ids


def test_generate_gives_request_i_seed_plus_i():
    model = make_model("llama", seed=5)
    gen = Generator(model, max_batch_size=4, max_seq_len=32)
    outs = gen.generate([PROMPTS[0]] * 3, SamplingParams(temperature=1.0, max_new_tokens=8, seed=40))
    for i, out in enumerate(outs):
        solo = gen.generate([PROMPTS[0]], [SamplingParams(temperature=1.0, max_new_tokens=8, seed=40 + i)])[0]
        assert out.token_ids == solo.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_sampler_matches_the_truncated_distribution():
    torch.manual_seed(0)
    vocab, n = 12, 40000
    logits = torch.randn(vocab) * 2
    rows = logits.expand(n, vocab)
    u = counter_uniform(torch.full((n,), 7), torch.arange(n))
    for top_k, top_p in [(vocab, 1.0), (4, 1.0), (vocab, 0.6), (5, 0.7)]:
        tokens, logp = sample_tokens(
            rows,
            torch.full((n,), 0.8),
            torch.full((n,), top_p),
            torch.full((n,), top_k),
            u,
            truncate=(top_k < vocab or top_p < 1),
        )
        probs = torch.softmax(logits / 0.8, -1)
        order = probs.argsort(descending=True)
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[order[:top_k]] = True
        p = torch.where(keep, probs, 0.0)
        p = p / p.sum()
        cum = p[order].cumsum(0)
        nucleus = torch.zeros(vocab, dtype=torch.bool)
        nucleus[order[(cum - p[order]) < top_p]] = True
        expected = torch.where(nucleus, p, 0.0)
        expected = expected / expected.sum()
        freq = torch.bincount(tokens, minlength=vocab).double() / n
        assert freq[~nucleus].sum() == 0  # truncated tokens are never drawn
        assert (freq - expected).abs().max() < 0.012  # ~5 sigma at n=40000
        assert torch.allclose(logp, torch.log_softmax(logits / 0.8, -1)[tokens], atol=1e-6)


def test_counter_uniform_is_a_pure_function_in_range():
    seeds = torch.tensor([0, 1, 2**40 + 3, 0])
    counters = torch.tensor([0, 0, 5, 1])
    u = counter_uniform(seeds, counters)
    assert torch.equal(u, counter_uniform(seeds, counters))
    assert ((u > 0) & (u < 1)).all() and len(set(u.tolist())) == 4
    assert counter_uniform(seeds[2:3], counters[2:3]).item() == u[2].item()
    # the sampler hashes Python ints: the same values as the int64-tensor path, up to the largest seed
    seeds, counters = torch.tensor([0, 2**40 + 3, 2**63 - 1, 12345]), torch.tensor([0, 5, 7, 2**31 + 9])
    assert [counter_uniform(int(s), int(c)) for s, c in zip(seeds, counters)] == counter_uniform(
        seeds, counters
    ).tolist()


def test_a_rows_draw_does_not_depend_on_other_rows_truncating():
    """A row without top-k / top-p draws the same token in a batch where another row truncates as alone: the CDF
    runs in vocabulary order for every row (at u near 0 a sorted CDF would give the most probable token, the
    vocabulary-order one the first token with mass; async decode, buckets and preemption change which rows share a
    step, so a batch-dependent draw changed the tokens a request got)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 50, generator=gen) * 3
    u = torch.cat([torch.tensor([1e-10, 1 - 1e-10], dtype=torch.float64), counter_uniform(torch.arange(6), 0)])
    alone, alone_logp = sample_tokens(logits, torch.ones(8), None, None, u, truncate=False)
    top_p, top_k = torch.ones(8), torch.full((8,), 50)
    top_p[-1], top_k[-2] = 0.5, 3  # the last two rows truncate
    mixed, mixed_logp = sample_tokens(logits, torch.ones(8), top_p, top_k, u, truncate=True)
    assert torch.equal(alone[:-2], mixed[:-2]) and torch.equal(alone_logp[:-2], mixed_logp[:-2])
    assert alone[0] == 0 and alone[1] == 49  # u at the ends of the CDF: the first and the last token with mass
    kept = logits[-2].topk(3).indices.tolist()
    assert mixed[-2].item() in kept


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_one_temperature_for_all_rows_samples_like_per_row_temperatures(temperature):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 4
    u = counter_uniform(torch.arange(6), torch.zeros(6, dtype=torch.int64))
    shared = sample_tokens(logits, temperature, None, None, u, truncate=False)
    per_row = sample_tokens(logits, torch.full((6,), temperature), None, None, u, truncate=False)
    assert torch.equal(shared[0], per_row[0]) and torch.equal(shared[1], per_row[1])


# ----------------------------------------------------------------------------- weight updates


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_grpo_groups_share_the_prompt_cache_exactly(kind):
    """4 samples per prompt with fewer slots than requests: the prompt's K/V is computed once per group (in the
    same prefill or copied from a resident slot at a refill), and every log-prob still equals a full forward."""
    model = make_model(kind, seed=12)
    group = 4
    prompts = [p for p in PROMPTS[:4] if len(p) > 1 for _ in range(group)]
    gen = Generator(model, max_batch_size=6, max_seq_len=40)
    outs = gen.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    assert gen.stats.prefill_tokens_shared > 0
    unique_prompt_tokens = sum(len(p) - 1 for p in prompts[::group])
    assert gen.stats.prefill_tokens < sum(len(p) - 1 for p in prompts)
    assert gen.stats.prefill_tokens + gen.stats.prefill_tokens_shared == sum(len(p) - 1 for p in prompts)
    assert gen.stats.prefill_tokens >= unique_prompt_tokens
    for prompt, out in zip(prompts, outs):
        ref = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref)) < 1e-4
    # and the tokens are those of generating each request alone (same seed)
    alone = Generator(model, max_batch_size=1, max_seq_len=40)
    for i in (0, 5, len(prompts) - 1):
        solo = alone.generate([prompts[i]], SamplingParams(temperature=1.0, max_new_tokens=6, seed=3 + i))[0]
        assert solo.token_ids == outs[i].token_ids


def test_keep_mode_never_shares_a_stale_prompt_cache():
    """After a swap in keep mode a resident slot's prompt K/V are the old weights': a new request with the same
    prompt must compute its own, so all its tokens are exactly the new policy's."""
    model = make_model("llama", seed=13)
    new_weights = perturbed_state_dict(model, seed=14)
    gen = Generator(model, max_batch_size=2, max_seq_len=40, interrupt_mode="keep")
    gen.add_request("old", PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=12))
    gen.step()
    gen.update_weights(new_weights, version=1)
    gen.add_request("new", PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=4))
    outs = {o.request_id: o for _ in range(12) for o in gen.step()}
    assert gen.stats.prefill_tokens_shared == 0
    new = make_model("llama", seed=13)
    new.load_state_dict(new_weights)
    ref = full_forward_logprobs(new, PROMPTS[2], outs["new"].token_ids)
    assert outs["new"].versions == [1] * 4
    assert max(abs(a - b) for a, b in zip(outs["new"].logprobs, ref)) < 1e-4


def perturbed_state_dict(model, seed):
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_weight_swap_mid_generation_is_exact_under_new_policy(kind):
    model = make_model(kind, seed=6)
    old = make_model(kind, seed=6)
    new_weights = perturbed_state_dict(model, seed=7)
    if kind == "qwen2":  # tied embeddings: HF state_dict names both keys for one tensor
        assert model.lm_head.weight is model.model.embed_tokens.weight
    gen = Generator(model, max_batch_size=3, max_seq_len=40)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    for i, prompt in enumerate(PROMPTS[:5]):
        gen.add_request(i, prompt, params)
    outs = {}
    for _ in range(4):
        outs.update({o.request_id: o for o in gen.step()})
    gen.update_weights(new_weights, version=1)
    assert gen.version == 1 and gen.stats.recompute_tokens > 0
    while gen.num_unfinished():
        outs.update({o.request_id: o for o in gen.step()})
    new = make_model(kind, seed=6)
    new.load_state_dict(new_weights)
    for i, prompt in enumerate(PROMPTS[:5]):
        out = outs[i]
        first_new = out.versions.index(1)
        assert out.versions == [0] * first_new + [1] * (len(out.versions) - first_new)
        assert (first_new == 4) if i < 3 else (first_new == 0)  # waiting requests start under v1
        ref_old = full_forward_logprobs(old, prompt, out.token_ids)
        ref_new = full_forward_logprobs(new, prompt, out.token_ids)
        for j, lp in enumerate(out.logprobs):
            assert abs(lp - (ref_old[j] if j < first_new else ref_new[j])) < 1e-4


def check_compiled_step_writes_the_pool_in_place(model, options: dict) -> None:
    """The assertions of test_compiled_step_writes_the_kv_pool_in_place for a model on any device (tests/gpu/test_gpu.py
    runs them on CUDA, with FlexAttention)."""
    from torch._inductor.utils import run_and_get_code

    gen = Generator(
        model,
        max_batch_size=3,
        max_seq_len=32,
        compile_decode=True,
        kv_cache_tokens=100_016,
        decode_buckets=[3],  # one decode width: two graphs to compile, with and without prefill rows
        **options,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    outs, codes = run_and_get_code(lambda: gen.generate(PROMPTS, params))
    shape = str(tuple(gen.kv_pool.storage.shape)).replace(" ", "")
    lines = [line.replace(" ", "") for code in codes for line in code.splitlines()]
    assert gen.stats.prefill_rides > 0 and len(codes) >= 2  # the decode graph and the one carrying prefill rows
    assert sum(shape in line and "assert_size_stride" in line for line in lines) >= 2  # the pool, an input of each
    assert not [line for line in lines if shape in line and "empty_strided" in line]
    for prompt, out in zip(PROMPTS, outs):
        full = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, full)) < 1e-4


# FlexAttention sees only q, k, v and the block mask: the families differ there by the window alone (GQA is common to
# all), so llama and mistral cover its cases; eager flex on CPU costs ~0.15 s a call (vmap over the mask)
FLEX_KINDS = [("llama", "flex"), ("mistral", "flex")]


@functools.cache
def padded_chunk_reference(kind: str):
    """The eager step's right-padded chunks through the gathered attention, once per family: the reference of both
    attention paths below (model, prompts, params, outputs)."""
    model = make_model(kind, seed=63)
    prompts, params = mixed_requests(stop=None)
    params = [dataclasses.replace(p, max_new_tokens=p.max_new_tokens + 10) for p in params]  # outgrow the pool
    pool = dict(kv_block_size=4, kv_cache_tokens=48, kv_seq_tokens=12, decode_attention="gather")
    return (
        model,
        prompts,
        params,
        run_streaming(Generator(model, max_batch_size=4, max_seq_len=40, **pool), prompts, params),
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "kind,attention", [(kind, "gather") for kind in ["llama", "qwen2", "mistral", "qwen3"]] + FLEX_KINDS
)
def test_packed_prefill_rows_equal_the_padded_chunk_in_the_eager_step(kind, attention):
    """ride_tokens in an eager step: the packed chunk (rows of several prompts one after another, each reading its
    sequence's blocks in the pool, through the gathered matmuls or FlexAttention's block mask) gives the tokens of
    the right-padded chunk that rides by default (through the gathered matmuls: one reference for both paths), log-probs within 1e-5, with GRPO sharing and a pool that
    preempts; with a budget of 5 the longer prompts do not fit (in an eager step the last chunk rides padded, as
    it does without ride_tokens)."""
    model, prompts, params, ref = padded_chunk_reference(kind)
    pool = dict(kv_block_size=4, kv_cache_tokens=48, kv_seq_tokens=12, decode_attention=attention)
    for budget in (5, 64):
        gen = Generator(model, max_batch_size=4, max_seq_len=40, ride_tokens=budget, **pool)
        outs = run_streaming(gen, prompts, params)
        assert gen.stats.prefill_rides > 0
        assert gen.stats.prefill_tokens_shared > 0 and gen.stats.preemptions > 0 and pool_is_empty(gen)
        for i in range(len(prompts)):
            assert outs[i].token_ids == ref[i].token_ids
            assert max(abs(a - b) for a, b in zip(outs[i].logprobs, ref[i].logprobs)) < 1e-5
    with pytest.raises(ValueError, match="ride_tokens must be >= 0"):
        Generator(model, max_batch_size=4, max_seq_len=40, ride_tokens=-1)


@pytest.mark.parametrize("layout", ["row", "input"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projections_follow_every_write_to_the_model(kind, layout):
    """q/k/v and gate/up run as one GEMM each over matrices the model's parameters are views of: a second
    Generator on the same model, update_weights through either, and load_state_dict all reach them."""
    model = make_model(kind, seed=13)
    first = Generator(model, max_batch_size=2, max_seq_len=40, weight_layout=layout)
    second = Generator(model, max_batch_size=2, max_seq_len=40)  # e.g. the rollout rank's eval generator
    params = SamplingParams(temperature=0, max_new_tokens=8)
    for weights, write in [
        (perturbed_state_dict(model, seed=14), lambda w: first.update_weights(w, version=1)),
        (perturbed_state_dict(model, seed=15), lambda w: model.load_state_dict(w)),
    ]:
        write(weights)
        ref = make_model(kind, seed=13)
        ref.load_state_dict(weights)
        for gen in (first, second):
            outs = gen.generate(PROMPTS[:3], params)
            for prompt, out in zip(PROMPTS[:3], outs):
                assert out.token_ids == hf_greedy(ref, prompt, 8)
                assert (
                    max(abs(a - b) for a, b in zip(out.logprobs, full_forward_logprobs(ref, prompt, out.token_ids)))
                    < 1e-4
                )


def test_blocked_lm_head_equals_one_gemm():
    """On CPU a vocabulary above 4 blocks goes through the LM head block by block: same logits."""
    from paged_forward import LM_HEAD_BLOCK

    torch.manual_seed(16)
    config = LlamaConfig(**{**COMMON, "vocab_size": 4 * LM_HEAD_BLOCK + 333})
    model = LlamaForCausalLM(config).eval()
    gen = Generator(model, max_batch_size=2, max_seq_len=16)
    h = torch.randn(5, COMMON["hidden_size"])
    assert torch.allclose(gen.forward.logits(h), model.lm_head(h).float(), atol=1e-5, rtol=0)
    out = gen.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert out.token_ids == hf_greedy(model, PROMPTS[0], 4)


def test_keep_mode_reuses_the_stale_cache():
    model = make_model("llama", seed=8)
    new_weights = perturbed_state_dict(model, seed=9)
    gen = Generator(model, max_batch_size=2, max_seq_len=40, interrupt_mode="keep")
    gen.add_request("a", PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=8))
    for _ in range(3):
        gen.step()
    prefilled = gen.stats.prefill_tokens
    gen.update_weights(new_weights, version=2)
    out = [o for _ in range(5) for o in gen.step()][0]
    assert gen.stats.prefill_tokens == prefilled and gen.stats.recompute_tokens == 0
    assert out.versions == [0, 0, 0, 2, 2, 2, 2, 2]
    new = make_model("llama", seed=8)
    new.load_state_dict(new_weights)
    ref_new = full_forward_logprobs(new, PROMPTS[2], out.token_ids)
    # the first post-swap token attends to K/V from the old weights, so it differs from the new policy
    assert abs(out.logprobs[3] - ref_new[3]) > 1e-4


def test_update_weights_accepts_buckets_and_rejects_bad_names():
    model = make_model("llama", seed=10)
    gen = Generator(model, max_batch_size=1, max_seq_len=16)
    weight = model.model.norm.weight
    gen.update_weights([("model.norm.weight", torch.full_like(weight, 2.0))], version=1)
    assert torch.equal(weight, torch.full_like(weight, 2.0)) and gen.version == 1
    with pytest.raises(KeyError, match="not_a_param"):
        gen.update_weights({"not_a_param": weight}, version=2)
    with pytest.raises(ValueError, match="shape"):
        gen.update_weights({"model.norm.weight": torch.zeros(3)}, version=2)
    with pytest.raises(ValueError, match="older"):
        gen.update_weights({}, version=0)


# ----------------------------------------------------------------------------- streaming API, bad input


def test_abort_and_unfinished_requests():
    gen = Generator(make_model("llama"), max_batch_size=1, max_seq_len=16)
    params = SamplingParams(temperature=0, max_new_tokens=5)
    gen.add_request("a", [1, 2], params)
    gen.add_request("b", [3], params)
    gen.step()
    pending = {r[0]: r for r in gen.unfinished_requests()}
    assert pending["a"][1] == [1, 2] and len(pending["a"][3]) == 1 and pending["b"][3] == []
    assert pending["a"][2].max_new_tokens == 5
    gen.abort("a")
    assert gen.slots[0] is None and gen.num_unfinished() == 1
    gen.abort("b")
    assert gen.num_unfinished() == 0 and gen.step() == []
    with pytest.raises(KeyError, match="unknown request"):
        gen.abort("zzz")


def test_bad_input_raises_clear_errors():
    model = make_model("llama")
    gen = Generator(model, max_batch_size=2, max_seq_len=16)
    ok = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.add_request(1, [], ok)
    with pytest.raises(ValueError, match="outside vocabulary"):
        gen.add_request(1, [VOCAB], ok)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        gen.add_request(1, [1] * 10, SamplingParams(max_new_tokens=8))
    for bad in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0), dict(max_new_tokens=0)]:
        with pytest.raises(ValueError, match="SamplingParams"):
            gen.add_request(1, [1], SamplingParams(**bad))
    gen.add_request(1, [1], ok)
    with pytest.raises(ValueError, match="already"):
        gen.add_request(1, [2], ok)
    gen.abort(1)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        gen.generate([[1], [2]], [ok])
    with pytest.raises(ValueError, match="outside vocabulary"):
        gen.generate([[1], [VOCAB + 5]], ok)
    assert gen.num_unfinished() == 0  # a failed generate leaves nothing behind
    with pytest.raises(ValueError, match="interrupt_mode"):
        Generator(model, interrupt_mode="pause")
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="gpt2"):
        Generator(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))


# ----------------------------------------------------------------------------- the paged KV cache


def pool_is_empty(gen) -> bool:
    pool = gen.kv_pool
    return (
        pool.num_free == pool.num_blocks
        and not any(pool.refs)
        and sorted(pool.free) == list(range(1, pool.num_blocks + 1))
        and not gen.block_table.any()
    )


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_tiny_pool_makes_admission_wait_and_preempts_with_the_same_outputs(kind):
    check_a_tiny_pool_waits_and_preempts_with_the_same_outputs(kind, compile_decode=False)


def check_a_tiny_pool_waits_and_preempts_with_the_same_outputs(kind: str, compile_decode: bool) -> None:
    """A pool of 10 blocks of 4 tokens for 4 slots whose sequences reach 20 tokens (5 blocks each): admission waits
    for blocks, and a running sequence that needs a block preempts the youngest request, which is recomputed on
    readmission. Tokens equal an unconstrained run's with the same seeds, log-probs a full forward's; GRPO groups
    (3 samples per prompt) share prompt blocks through it all, and every block is back in the free list at the end.
    The compiled (static-shape) decode step too (tests/compiled/): its block tables keep their full width throughout."""
    model = make_model(kind, seed=30)
    prompts = [p for p in PROMPTS[:4] for _ in range(3)] + [[40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(temperature=1.0, max_new_tokens=14, seed=8)
    ref = Generator(model, max_batch_size=4, max_seq_len=40).generate(prompts, params)
    gen = Generator(
        model,
        max_batch_size=4,
        max_seq_len=40,  # the compiled tier's geometry (tests/compiled/): its graphs are shared
        kv_block_size=4,
        kv_cache_tokens=40,
        kv_seq_tokens=8,
        compile_decode=compile_decode,
    )
    assert gen.max_batch_size == 4 and gen.kv_pool.num_blocks == 10
    for i, p in enumerate(prompts):
        gen.add_request(i, p, dataclasses.replace(params, seed=params.seed + i))
    outs, admission_waited = {}, False
    while gen.num_unfinished():
        outs.update((o.request_id, o) for o in gen.step())
        admission_waited |= bool(gen.waiting) and None in gen.slots
        assert gen.kv_pool.num_used <= gen.kv_pool.num_blocks
    assert admission_waited and gen.stats.preemptions > 0 and gen.stats.prefill_tokens_shared > 0
    for i, prompt in enumerate(prompts):
        assert outs[i].token_ids == ref[i].token_ids
        assert max(abs(a - b) for a, b in zip(outs[i].logprobs, ref[i].logprobs)) < 1e-4
        full = full_forward_logprobs(model, prompt, outs[i].token_ids)
        assert max(abs(a - b) for a, b in zip(outs[i].logprobs, full)) < 1e-4
    assert pool_is_empty(gen) and gen.kv_pool.peak_used == gen.kv_pool.num_blocks


def test_every_block_returns_to_the_free_list():
    """generate(), stop tokens, an abort of a running and of a waiting request, and a weight swap (recompute: stale
    blocks go back, fresh ones are taken) all leave the pool as it started; K/V sharing is refcounted."""
    model = make_model("qwen2", seed=31)
    gen = Generator(model, max_batch_size=3, max_seq_len=32, kv_block_size=4, kv_cache_tokens=48, kv_seq_tokens=8)
    outs = gen.generate([PROMPTS[0]] * 4 + PROMPTS[1:], SamplingParams(temperature=1.0, max_new_tokens=10, seed=2))
    stop = outs[0].token_ids[2]
    gen.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=2, stop_token_ids=[stop]))
    assert pool_is_empty(gen) and gen.stats.prefill_tokens_shared > 0
    for i, p in enumerate([PROMPTS[2]] * 3 + PROMPTS[3:]):
        gen.add_request(i, p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i))
    gen.step()
    shared = [b for b in gen.slots[0].blocks if gen.kv_pool.refs[b] > 1]
    assert shared and all(b in gen.slots[1].blocks for b in shared)  # one prompt block, three sequences
    gen.step()
    gen.abort(0)  # running
    gen.abort(5)  # waiting
    gen.update_weights(perturbed_state_dict(model, seed=3), version=1)
    assert all(not r.blocks for r in gen.slots if r is not None)  # recompute mode: stale K/V given back at once
    while gen.num_unfinished():
        gen.step()
    assert pool_is_empty(gen)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_decode_attention_reads_only_live_blocks(kind):
    check_decode_attention_reads_only_live_blocks(kind, compile_decode=False)


def check_decode_attention_reads_only_live_blocks(kind: str, compile_decode: bool) -> None:
    """Every free block is filled with NaN after each step: a gathered free block would turn the outputs into NaN
    (masked or not: 0 * NaN), yet they equal a clean run's bit for bit. Eager decode gathers ceil(longest / block)
    blocks per slot; the compiled step (static shapes, tests/compiled/) every entry of the block table, the unused ones the null
    block, masked (Mistral's window of 5 masks inside the live blocks too)."""
    model = make_model(kind, seed=32)
    prompts = PROMPTS + [[40, 41, 42, 43, 44, 45, 46, 47, 48]]
    limits = [3, 15, 6, 18, 9, 4, 12]
    options = dict(max_batch_size=3, max_seq_len=40, kv_block_size=4, compile_decode=compile_decode)
    clean, poisoned = Generator(model, **options), Generator(model, **options)
    assert clean.block_size == 4 and clean.max_blocks == 10
    results = []
    for gen in (clean, poisoned):
        for i, (p, n) in enumerate(zip(prompts, limits)):
            gen.add_request(i, p, SamplingParams(temperature=1.0, max_new_tokens=n, seed=i))
        outs, spans = {}, []
        while gen.num_unfinished():
            done = gen.step()
            outs.update((o.request_id, o) for o in done)
            decoded = [r.prompt_ids + r.token_ids for r in gen.slots if r is not None] + [
                o.prompt_ids + o.token_ids for o in done
            ]
            longest = max(len(t) - 1 for t in decoded)  # the longest position read, plus one
            assert gen.decode_span == (40 if compile_decode else -(-longest // 4) * 4)
            spans.append(gen.decode_span)
            if gen is poisoned:
                free = torch.tensor(gen.kv_pool.free, dtype=torch.long)
                for layer in gen.kv_pool.k + gen.kv_pool.v:
                    layer.index_fill_(1, free, float("nan"))
        results.append(([(outs[i].token_ids, outs[i].logprobs) for i in range(len(prompts))], spans))
    assert results[0] == results[1]
    assert compile_decode or min(results[0][1]) < max(results[0][1]) < 40  # the span follows the live lengths
    for prompt, (tokens, logprobs) in zip(prompts, results[0][0]):
        assert max(abs(a - b) for a, b in zip(logprobs, full_forward_logprobs(model, prompt, tokens))) < 1e-4


def test_eval_and_rollout_generators_share_one_pool():
    """The rollout rank's eval generator allocates from the rollout generator's pool (RolloutWorker.on_eval): each
    sees the other's blocks. The eval run, stepped while rollout requests sit in the pool, takes their blocks (they
    are preempted and recomputed later); both give the outputs of generators with a pool each."""
    from types import SimpleNamespace

    from config import RolloutConfig
    from rollout import RolloutWorker

    model = make_model("llama", seed=33)
    rollout_params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=i) for i in range(4)]
    ref_rollout = Generator(model, max_batch_size=4, max_seq_len=32).generate(PROMPTS[:4], rollout_params)
    eos = VOCAB - 1
    ref_eval = Generator(model, max_batch_size=4, max_seq_len=32).generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[eos])
    )

    worker = RolloutWorker.__new__(RolloutWorker)  # just what on_eval reads: a follower's (it does not score)
    rollout = RolloutConfig(max_batch_size=4, max_seq_len=32, max_new_tokens=10, kv_seq_tokens=8)  # 32 tokens: 4 slots
    worker.cfg, worker.replica = SimpleNamespace(rollout=rollout), None
    worker.model, worker.tok = model, SimpleNamespace(eos_token_id=eos)
    worker.weights_incomplete, worker.eval_gen, worker.scorer, worker.is_leader = False, None, None, False
    worker.generate_s, worker.generate_cpu_s, worker.generate_steps = 0.0, 0.0, 0
    worker.encoded = {("test", i): p for i, p in enumerate(PROMPTS)}
    worker.gen = Generator(
        model, max_batch_size=4, max_seq_len=32, kv_block_size=4, kv_cache_tokens=32, kv_seq_tokens=8
    )
    pool = worker.gen.kv_pool
    for i, p in enumerate(PROMPTS[:4]):
        worker.gen.add_request(i, p, rollout_params[i])
    rollout_outs = {}
    for _ in range(3):
        rollout_outs.update((o.request_id, o) for o in worker.gen.step())
    held = pool.num_used
    assert held > 0

    eval_outs = {}
    step = worker.step
    worker.step = lambda gen: [eval_outs.setdefault(o.request_id, o) for o in step(gen)]
    worker.on_eval({"version": 0, "prompt_ids": list(range(len(PROMPTS)))})
    assert worker.eval_gen.kv_pool is pool and worker.eval_gen.block_size == 4
    assert worker.gen.stats.preemptions > 0 and pool.peak_used == pool.num_blocks  # eval took rollout's blocks
    assert [eval_outs[j].token_ids for j in range(len(PROMPTS))] == [o.token_ids for o in ref_eval]
    assert pool.num_used < held  # eval's blocks are back; the preempted rollout requests wait for theirs

    worker.eval_gen.add_request("e", PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=4))
    worker.eval_gen.step()  # one generator's allocation is the other's view of the pool
    assert worker.gen.kv_pool.num_used == pool.num_used > 0
    worker.eval_gen.abort("e")
    while worker.gen.num_unfinished():
        rollout_outs.update((o.request_id, o) for o in worker.gen.step())
    for i in range(4):
        assert rollout_outs[i].token_ids == ref_rollout[i].token_ids
        assert max(abs(a - b) for a, b in zip(rollout_outs[i].logprobs, ref_rollout[i].logprobs)) < 1e-4
    assert pool_is_empty(worker.gen) and pool_is_empty(worker.eval_gen)


def test_pool_size_and_slot_count_come_from_the_config(monkeypatch):
    import generator
    from config import ConfigError, RolloutConfig
    from generator import kv_options
    from kv_cache import KVPool

    model = make_model("llama", seed=34)
    default = Generator(model, max_batch_size=3, max_seq_len=30)  # a static cache's size, blocks of 16
    assert default.max_batch_size == 3 and default.kv_pool.num_blocks == 3 * 2 and default.block_size == 16
    assert tuple(default.k_cache[0].shape) == (3, COMMON["num_key_value_heads"], 30, 16)
    sized = Generator(model, max_batch_size=8, max_seq_len=32, kv_block_size=8, kv_cache_tokens=100, kv_seq_tokens=16)
    assert sized.kv_pool.num_blocks == 13 and sized.max_batch_size == 104 // 16  # slots from memory, capped at 8
    token_bytes = KVPool.token_bytes(2, COMMON["num_key_value_heads"], 16, torch.float32)
    monkeypatch.setattr(generator, "available_memory", lambda device: 1000 * token_bytes)
    frac = Generator(model, max_batch_size=64, max_seq_len=32, kv_cache_fraction=0.5, kv_block_size=10)
    assert frac.kv_pool.num_blocks == 50 and frac.max_batch_size == 500 // 32
    assert frac.kv_pool.block_bytes == 10 * token_bytes
    with pytest.raises(ValueError, match="raise kv_cache_tokens or kv_cache_fraction"):
        Generator(model, max_seq_len=32, kv_cache_tokens=16)  # one block of 16: a sequence needs two
    with pytest.raises(ValueError, match="kv_pool holds"):
        Generator(make_model("llama").to(torch.bfloat16), max_seq_len=32, kv_pool=sized.kv_pool)
    with pytest.raises(ValueError, match="kv_pool is given"):
        Generator(model, max_seq_len=32, kv_pool=sized.kv_pool, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        Generator(model, max_seq_len=32, kv_cache_fraction=1.0)

    ok = RolloutConfig(max_seq_len=64)
    assert kv_options(ok) == dict(kv_block_size=16, kv_cache_tokens=0, kv_cache_fraction=0.0, kv_seq_tokens=0)
    for bad, key in [
        (dict(kv_cache_fraction=1.0), "rollout.kv_cache_fraction"),
        (dict(kv_cache_fraction=-0.1), "rollout.kv_cache_fraction"),
        (dict(kv_cache_tokens=-1), "rollout.kv_cache_tokens"),
        (dict(kv_cache_tokens=63), "rollout.kv_cache_tokens"),
        (dict(kv_block_size=0), "rollout.kv_block_size"),
        (dict(kv_seq_tokens=65), "rollout.kv_seq_tokens"),
    ]:
        with pytest.raises(ConfigError, match=key):
            kv_options(dataclasses.replace(ok, **bad))


# ----------------------------------------------------------------------------- async decode, batch buckets, FlexAttention


def mixed_requests(stop: int | None):
    """GRPO-style groups with mixed sampling settings: greedy, temperatures, top-p, top-k, length limits and a stop
    token, so every branch of the sampler and both ways to finish occur in one batch."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=7),
        dict(temperature=0.7, top_p=0.8, top_k=20),
        dict(temperature=1.0),
    ]
    stops = [stop] if stop is not None else []
    params = [
        SamplingParams(**settings[i % len(settings)], max_new_tokens=4 + (5 * i) % 11, stop_token_ids=stops, seed=i)
        for i in range(len(prompts))
    ]
    return prompts, params


def run_streaming(gen, prompts, params, swap=None, abort=None):
    """Streamed requests; optionally update_weights(swap) and abort(abort) after the 4th step()."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        gen.add_request(i, p, sp)
    outs, calls = {}, 0
    while gen.num_unfinished():
        outs.update((o.request_id, o) for o in gen.step())
        calls += 1
        if calls == 4 and abort is not None:
            gen.abort(abort)
        if calls == 4 and swap is not None:
            gen.update_weights(swap, version=1)
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_async_decode_gives_the_same_tokens_logprobs_and_versions(kind):
    """async_decode (the host reads step k's tokens while step k+1 runs; the next step's input tokens are read on
    the device; seeds and counters go to the device, the sampler runs there): the same tokens, log-probs and finish
    reasons as the synchronous loop, with stop tokens (a stopped request's row in the step after is dropped),
    length limits (known on the host: the slot frees in the step that draws the last token) and every sampler branch."""
    model = make_model(kind, seed=40)
    free = Generator(model, max_batch_size=4, max_seq_len=40).generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=8)
    )
    prompts, params = mixed_requests(stop=free[0].token_ids[3])
    results = {}
    for async_decode in (False, True):
        gen = Generator(model, max_batch_size=4, max_seq_len=40, async_decode=async_decode)
        assert gen.async_decode == async_decode
        results[async_decode] = (run_streaming(gen, prompts, params), gen)
    (sync, sync_gen), (lagged, async_gen) = results[False], results[True]
    assert {o.finish_reason for o in sync.values()} == {"stop", "length"}
    for i, prompt in enumerate(prompts):
        a, b = sync[i], lagged[i]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.versions == b.versions
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        temperature = params[i].temperature or 1.0
        ref = full_forward_logprobs(model, prompt, b.token_ids, temperature=temperature)
        assert max(abs(x - y) for x, y in zip(ref, b.logprobs)) < 1e-4
    assert (
        async_gen.stats.generated_tokens
        == sync_gen.stats.generated_tokens
        == sum(len(o.token_ids) for o in sync.values())
    )
    # a stop is seen a step late, so a stopped slot refills a step later: a few more steps, never fewer
    assert async_gen.stats.decode_steps >= sync_gen.stats.decode_steps
    assert pool_is_empty(async_gen) and not async_gen._launched


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_async_decode_under_weight_swaps_preemption_and_abort(kind):
    """With length limits only the asynchronous schedule is the synchronous one step for step, so a weight swap
    and an abort after the same step() call give the same tokens and version stamps (the swap first reads the
    launched step: its tokens are the old weights'); a pool of 10 blocks of 4 tokens preempts (a preempted
    request's launched token is read first) and every block comes back."""
    model = make_model(kind, seed=41)
    prompts = [p for p in PROMPTS[:4] for _ in range(3)] + [[40, 41, 42, 43, 44, 45, 46]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6 + i % 9, seed=i) for i in range(len(prompts))]
    swap = perturbed_state_dict(model, seed=9)
    runs = {}
    for async_decode in (False, True):
        for tiny_pool in (False, True):
            pool = dict(kv_block_size=4, kv_cache_tokens=40, kv_seq_tokens=8) if tiny_pool else {}
            m = make_model(kind, seed=41)
            gen = Generator(m, max_batch_size=4, max_seq_len=32, async_decode=async_decode, **pool)
            runs[async_decode, tiny_pool] = (run_streaming(gen, prompts, params, swap=swap, abort=1), gen)
    for tiny_pool in (False, True):
        (sync, _), (lagged, gen) = runs[False, tiny_pool], runs[True, tiny_pool]
        assert sorted(sync) == sorted(lagged) and 1 not in lagged
        for i in sync:
            assert sync[i].token_ids == lagged[i].token_ids and sync[i].versions == lagged[i].versions
            assert max(abs(x - y) for x, y in zip(sync[i].logprobs, lagged[i].logprobs)) < 1e-5
        assert any(1 in o.versions and 0 in o.versions for o in lagged.values())
        assert pool_is_empty(gen)
        assert (gen.stats.preemptions > 0) == tiny_pool
    # and the unconstrained pool's tokens are the tiny pool's
    for i in runs[True, False][0]:
        assert runs[True, False][0][i].token_ids == runs[True, True][0][i].token_ids


def test_async_decode_returns_a_stopped_request_one_step_later():
    """step() with async_decode returns a request once the host has read its last token: a step later for a stop
    token, whose slot then refills a step later; a length limit frees the slot in the step the last token is drawn."""
    model = make_model("llama", seed=42)
    probe = Generator(model, max_batch_size=2, max_seq_len=32).generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4)
    )
    stop = probe[0].token_ids[1]  # "short" stops on its second token
    assert probe[0].token_ids[0] != stop
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=[stop])
    for async_decode, returned_at in ((False, 2), (True, 3)):
        gen = Generator(model, max_batch_size=2, max_seq_len=32, async_decode=async_decode)
        gen.add_request("short", [1, 2, 3], params)
        gen.add_request("long", [4, 5], SamplingParams(temperature=0, max_new_tokens=4))
        gen.add_request("late", [6], SamplingParams(temperature=0, max_new_tokens=3))
        calls, seen = 0, {}
        while gen.num_unfinished():
            calls += 1
            seen.update((o.request_id, calls) for o in gen.step())
        assert seen["short"] == returned_at
        assert seen["long"] == 4 + async_decode  # a length limit: read a step later, its slot freed in time
        assert gen.stats.generated_tokens == 2 + 4 + 3


def test_decode_buckets_pad_the_batch_without_changing_results():
    """decode_buckets pads the running rows to the smallest power of two (or max_batch_size, or of the widths given)
    that holds them -- the shapes a compiled step captures one graph for -- and the padding changes no token or
    log-prob."""
    model = make_model("qwen2", seed=43)
    prompts, params = mixed_requests(stop=None)
    # one request per slot, the tail draining from the highest slot down: 6 slots in use, then 5, ... 1
    prompts, params = prompts[:6], [dataclasses.replace(p, max_new_tokens=24 - 4 * i) for i, p in enumerate(params[:6])]
    results, widths = {}, {}
    for buckets in (False, True, (3, 99)):  # given widths: capped at max_batch_size, which is always one
        gen = Generator(model, max_batch_size=6, max_seq_len=40, decode_buckets=buckets)
        assert gen.buckets == ([3, 6] if buckets == (3, 99) else [1, 2, 4, 6])
        for i, (p, sp) in enumerate(zip(prompts, params)):
            gen.add_request(i, p, sp)
        outs, seen = {}, set()
        while gen.num_unfinished():
            outs.update((o.request_id, o) for o in gen.step())
            if gen.stats.decode_steps:
                seen.add(gen.decode_width)
        results[buckets], widths[buckets] = outs, seen
    assert widths[True] == {1, 2, 4, 6} and widths[False] == {1, 2, 3, 4, 5, 6} and widths[(3, 99)] == {3, 6}
    for padded in (True, (3, 99)):
        for i in results[False]:
            assert results[False][i].token_ids == results[padded][i].token_ids
            assert max(abs(x - y) for x, y in zip(results[False][i].logprobs, results[padded][i].logprobs)) < 1e-5
    with pytest.raises(ValueError, match="batch widths >= 1"):
        Generator(model, max_batch_size=6, max_seq_len=40, decode_buckets=[0, 4])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", [kind for kind, _ in FLEX_KINDS])
def test_flex_attention_decode_matches_the_gathered_path(kind):
    """decode_attention="flex" (the GPU default): FlexAttention over the pool in place, the block mask built from
    the block tables (each slot visits its own blocks; the mask_mod maps a pool row to its sequence position and
    cuts the last block, and Mistral's window). Run here as eager flex_attention on CPU: greedy equals HF, and
    sampled GRPO groups (shared prompt blocks) through a tiny pool (preemption, reused blocks) give the tokens of
    the gathered-matmul path, log-probs within 1e-5."""
    model = make_model(kind, seed=44)
    gen = Generator(model, max_batch_size=3, max_seq_len=40, decode_attention="flex")
    assert gen.decode_attention == "flex"
    for prompt, out in zip(PROMPTS, gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=9))):
        assert out.token_ids == hf_greedy(model, prompt, 9)
        ref = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
    prompts = [p for p in PROMPTS[:4] for _ in range(3)] + [[40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=14, seed=8)
    pool = dict(kv_block_size=4, kv_cache_tokens=40, kv_seq_tokens=8)
    outs = {}
    for attention in ("gather", "flex"):
        g = Generator(model, max_batch_size=4, max_seq_len=32, decode_attention=attention, **pool)
        outs[attention] = g.generate(prompts, params)
        assert g.stats.preemptions > 0 and g.stats.prefill_tokens_shared > 0 and pool_is_empty(g)
    for a, b in zip(outs["gather"], outs["flex"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # compiled on CPU, inductor's flex kernel cannot read the pool in place: one clear error at construction, not
    # a lowering failure at the first step
    with pytest.raises(ValueError, match="flex' with compile_decode=True runs on a GPU only"):
        Generator(model, max_batch_size=4, max_seq_len=32, decode_attention="flex", compile_decode=True)
