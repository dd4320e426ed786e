"""Tensor-parallel generator.Generator (tp_group): two gloo ranks on CPU against HF and the single-process Generator.

One spawn of 2 ranks (module fixture) runs every TP case and saves each rank's outputs; the tests compare them:
greedy == HF generate with log-probs within 1e-4 of HF's full forward (Llama GQA, Llama with attention/MLP biases,
Qwen2 tied + q/k/v bias, Mistral with a window shorter than the sequences, Qwen3 q/k norms), a weight swap mid-generation == the
single-process Generator doing the same swap, both ranks bit-identical, and the clear errors for bad input. The compiled
decode step of a TP-2 replica (inductor on CPU, its collectives inside the graph) through a weight swap and preemptions
== the eager single-process Generator and HF generate under each version.
"""

import dataclasses
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = [os.path.join(ROOT, "tests", d) for d in ("support", "unit")]
sys.path[:0] = [p for p in (ROOT, *TESTS) if p not in sys.path]

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from test_generator import (  # noqa: E402
    COMMON,
    PROMPTS,
    full_forward_logprobs,
    hf_greedy,
    make_model,
    perturbed_state_dict,
)
from torch._dynamo.utils import counters  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import generator  # noqa: E402
from generator import Generator, SamplingParams  # noqa: E402

torch.set_num_threads(1)
TP = 2
KINDS = ["llama", "llama_bias", "qwen2", "mistral", "qwen3"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
SWAP_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
TIMEOUT_S = 480  # the compiled case compiles two graphs per rank (~90 s on 2 shared cores)
# the compiled case: Llama with o_proj / down_proj biases (added once, after the step's all-reduces), 3 slots in a pool
# of 10 blocks of 4 tokens (sequences reach 17: requests wait and are preempted), one decode width (two graphs: with
# and without packed prefill rows), greedy, the weights swapped after 4 steps (recompute)
COMPILED_KIND = "llama_bias"
COMPILED_POOL = dict(max_batch_size=3, max_seq_len=40, kv_block_size=4, kv_cache_tokens=40, kv_seq_tokens=8)


def build(kind: str, seed: int):
    """test_generator's tiny fp32 models, plus Llama with o_proj / down_proj biases (HF inits them to 0:
    perturbed, so a bias added once per rank instead of once would show)."""
    if kind != "llama_bias":
        return make_model(kind, seed)
    model = make_model("llama", seed, attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def as_lists(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.versions, o.finish_reason) for o in outs]


def weight_swap(gen: Generator, new_weights: dict, params: SamplingParams = SWAP_SAMPLING) -> list[tuple]:
    """5 requests on 3 slots, 4 steps under version 0, update_weights (recompute), the rest under version 1."""
    for i, prompt in enumerate(PROMPTS[:5]):
        gen.add_request(i, prompt, dataclasses.replace(params, seed=100 + i))
    done = {}
    for _ in range(4):
        done.update((o.request_id, o) for o in gen.step())
    gen.update_weights(new_weights, version=1)
    while gen.num_unfinished():
        done.update((o.request_id, o) for o in gen.step())
    return as_lists(done[i] for i in range(5))


def error_of(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP, timeout=timedelta(seconds=120)
    )
    group = dist.new_group(list(range(TP)))
    res: dict = {}
    try:
        for kind in KINDS:
            model = build(kind, seed=1)
            gen = Generator(model, max_batch_size=3, max_seq_len=40, tp_group=group)  # 6 prompts, 3 slots
            attn = model.model.layers[0].self_attn
            res[kind, "shapes"] = {
                "q_proj": tuple(attn.q_proj.weight.shape),
                "k_proj": tuple(attn.k_proj.weight.shape),
                "o_proj": tuple(attn.o_proj.weight.shape),
                "down_proj": tuple(model.model.layers[0].mlp.down_proj.weight.shape),
                "embed": tuple(model.model.embed_tokens.weight.shape),
                "lm_head": tuple(model.lm_head.weight.shape),
                "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                "k_cache": tuple(gen.k_cache[0].shape),
            }
            res[kind, "greedy"] = as_lists(gen.generate(PROMPTS, GREEDY))
            # the rollout rank's eval generator: a second Generator over the already sharded model; a prefill
            # budget of 1 token makes every prefill chunk but a step's last a prefill-only forward
            second = Generator(model, max_batch_size=3, max_seq_len=40, max_prefill_tokens=1, tp_group=group)
            res[kind, "eval"] = as_lists(second.generate(PROMPTS[:3], GREEDY))
            res[kind, "eval_prefill_forwards"] = second.stats.prefill_forwards
            res[kind, "q_proj_after_second"] = tuple(attn.q_proj.weight.shape)

            model = build(kind, seed=6)
            new_weights = perturbed_state_dict(model, seed=7)  # full HF tensors, as the weight sync sends them
            res[kind, "swap"] = weight_swap(
                Generator(model, max_batch_size=3, max_seq_len=40, tp_group=group), new_weights
            )

        # the paged KV cache: a tiny pool makes both ranks wait and preempt alike (same calls, same decisions); a
        # pool sized from memory takes the smallest rank's size (here rank 0 has half of rank 1's memory)
        model = build("llama", seed=1)
        tiny = Generator(
            model,
            max_batch_size=3,
            max_seq_len=40,
            kv_block_size=4,
            kv_cache_tokens=40,
            kv_seq_tokens=8,
            tp_group=group,
        )
        res["tiny_pool"] = as_lists(tiny.generate(PROMPTS, dataclasses.replace(GREEDY, max_new_tokens=16)))
        res["tiny_pool_preemptions"] = tiny.stats.preemptions
        available, generator.available_memory = generator.available_memory, lambda device: (1 + rank) * 2**20
        try:
            res["fraction_blocks"] = Generator(
                model, max_seq_len=40, kv_cache_fraction=0.5, tp_group=group
            ).kv_pool.num_blocks
        finally:
            generator.available_memory = available

        # bad input: each refused before any collective, on every rank alike
        one_kv = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_key_value_heads": 1})).eval()
        res["error_kv_heads"] = error_of(lambda: Generator(one_kv, max_seq_len=16, tp_group=group))
        sharded = make_model("llama")
        gen = Generator(sharded, max_batch_size=1, max_seq_len=16, tp_group=group)
        local_q = sharded.model.layers[0].self_attn.q_proj.weight
        res["error_shape"] = error_of(
            lambda: gen.update_weights({"model.layers.0.self_attn.q_proj.weight": local_q.clone()}, version=1)
        )
        res["error_untp_on_sharded"] = error_of(lambda: Generator(sharded, max_seq_len=16))

        # the compiled decode step under TP (inductor on CPU): the code inductor generates, the graph breaks
        model = build(COMPILED_KIND, seed=1)
        new_weights = perturbed_state_dict(model, seed=2)
        compiled = Generator(model, compile_decode=True, decode_buckets=[3], tp_group=group, **COMPILED_POOL)
        breaks = sum(counters["graph_break"].values())
        res["compiled_swap"], codes = run_and_get_code(lambda: weight_swap(compiled, new_weights, GREEDY))
        res["compiled_graph_breaks"] = sum(counters["graph_break"].values()) - breaks
        res["compiled_stats"] = dataclasses.asdict(compiled.stats)
        res["compiled_codes"] = [
            ("all_reduce" in code, "all_gather_into_tensor" in code, "wait_tensor" in code) for code in codes
        ]
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' saved outputs: [rank 0's, rank 1's]."""
    d = tmp_path_factory.mktemp("tp")
    ctx = mp.start_processes(_rank_main, args=(str(d / "init"), str(d)), nprocs=TP, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"TP ranks did not finish within {TIMEOUT_S} s (a collective out of step?)")
    return [torch.load(d / f"rank{r}.pt", weights_only=True) for r in range(TP)]


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_greedy_matches_hf_generate_and_full_forward(ranks, kind):
    model = build(kind, seed=1)
    res = ranks[0]
    # the second Generator (prefill-only forwards) reused the shard, not sliced again: HF's outputs too
    outs = list(zip(PROMPTS, res[kind, "greedy"])) + list(zip(PROMPTS, res[kind, "eval"]))
    assert len(outs) == len(PROMPTS) + 3
    for prompt, (tokens, logprobs, versions, reason) in outs:
        assert tokens == hf_greedy(model, prompt, GREEDY.max_new_tokens)
        ref = full_forward_logprobs(model, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(ref, logprobs)) < 1e-4
        assert versions == [0] * len(tokens) and reason == "length"
    assert res[kind, "q_proj_after_second"] == res[kind, "shapes"]["q_proj"]
    assert res[kind, "eval_prefill_forwards"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_each_rank_holds_half_the_weights_and_its_kv_heads(ranks, kind):
    h, inter, v = COMMON["hidden_size"], COMMON["intermediate_size"], COMMON["vocab_size"]
    head_dim = h // COMMON["num_attention_heads"]
    shapes = ranks[0][kind, "shapes"]
    assert shapes["q_proj"] == (h // TP, h) and shapes["k_proj"] == (COMMON["num_key_value_heads"] // TP * head_dim, h)
    assert shapes["o_proj"] == (h, h // TP) and shapes["down_proj"] == (h, inter // TP)
    assert shapes["embed"] == shapes["lm_head"] == (v // TP, h)
    assert shapes["tied"] == (kind == "qwen2")
    assert shapes["k_cache"] == (3, COMMON["num_key_value_heads"] // TP, 40, head_dim)


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_weight_swap_mid_generation_matches_single_process(ranks, kind):
    model = build(kind, seed=6)
    new_weights = perturbed_state_dict(model, seed=7)
    ref = weight_swap(Generator(model, max_batch_size=3, max_seq_len=40), new_weights)
    got = ranks[0][kind, "swap"]
    swapped = 0
    for (tokens, logprobs, versions, reason), (ref_tokens, ref_logprobs, ref_versions, ref_reason) in zip(got, ref):
        assert tokens == ref_tokens and versions == ref_versions and reason == ref_reason
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
        swapped += versions.count(1)
    assert 0 < swapped < sum(len(t[0]) for t in got)  # both versions sampled tokens


def test_tp2_ranks_produce_identical_outputs(ranks):
    for kind in KINDS:
        for case in ("greedy", "eval", "swap"):
            assert ranks[0][kind, case] == ranks[1][kind, case], (kind, case)


def test_tp2_paged_kv_cache_keeps_the_ranks_in_lockstep(ranks):
    """A pool of 10 blocks of 4 tokens for 3 slots (sequences of 22 tokens need 6): both ranks preempt the same
    requests and give HF's greedy tokens; a pool sized by kv_cache_fraction is the smaller rank's on both."""
    model = build("llama", seed=1)
    assert ranks[0]["tiny_pool"] == ranks[1]["tiny_pool"] and ranks[0]["tiny_pool_preemptions"] > 0
    for prompt, (tokens, logprobs, versions, reason) in zip(PROMPTS, ranks[0]["tiny_pool"]):
        assert tokens == hf_greedy(model, prompt, 16) and reason == "length" and versions == [0] * 16
        assert max(abs(a - b) for a, b in zip(full_forward_logprobs(model, prompt, tokens), logprobs)) < 1e-4
    block_bytes = 16 * 2 * COMMON["num_hidden_layers"] * (COMMON["num_key_value_heads"] // TP) * 16 * 4
    assert ranks[0]["fraction_blocks"] == ranks[1]["fraction_blocks"] == 2**19 // block_bytes  # rank 0's half MiB


# ----------------------------------------------------------------------------- bad input, options


def test_tp2_bad_input_raises_clear_errors(ranks):
    for res in ranks:
        assert res["error_kv_heads"].startswith("ValueError: tp=2 must divide num_key_value_heads=1")
        err = res["error_shape"]
        assert "model.layers.0.self_attn.q_proj.weight" in err and "(32, 64)" in err and "(64, 64)" in err
        assert "holds TP shard" in res["error_untp_on_sharded"]


# ----------------------------------------------------------------------------- the compiled step


def test_tp2_compiled_step_matches_eager_single_process_and_hf_through_a_swap_and_preemptions(ranks):
    """compile_decode=True on a TP-2 replica: inductor compiled the decode step with the all-reduces and the logits'
    all-gather inside each graph (functional collectives, no graph break), and it ran the whole generation: greedy
    tokens and versions equal the eager single-process Generator's doing the same swap, log-probs within 1e-5 of
    them; before the swap the tokens are HF generate's under the old weights, after it HF generate's under the new
    ones continuing the sequence, log-probs within 1e-4 of the matching full forward; the tiny pool preempted."""
    res = ranks[0]
    assert ranks[1]["compiled_swap"] == res["compiled_swap"]
    assert len(res["compiled_codes"]) >= 2 and all(all(has) for has in res["compiled_codes"])
    assert res["compiled_graph_breaks"] == 0
    stats = res["compiled_stats"]
    assert stats["preemptions"] > 0 and stats["prefill_rides"] > 0
    assert stats["weight_updates"] == 1 and stats["recompute_tokens"] > 0
    old, model = build(COMPILED_KIND, seed=1), build(COMPILED_KIND, seed=1)
    new_weights = perturbed_state_dict(model, seed=2)  # before a Generator fuses (and may transpose) the weights
    ref = weight_swap(Generator(model, **COMPILED_POOL), new_weights, GREEDY)  # the eager single-process Generator
    swapped = 0
    for prompt, got, want in zip(PROMPTS, res["compiled_swap"], ref):
        tokens, logprobs, versions, reason = got
        assert tokens == want[0] and versions == want[2] and reason == want[3] == "length"
        assert max(abs(a - b) for a, b in zip(logprobs, want[1])) < 1e-5
        hf, full = _greedy_under_versions(old, model, prompt, tokens, versions)  # model: the new weights
        assert tokens == hf
        assert max(abs(a - b) for a, b in zip(logprobs, full)) < 1e-4
        swapped += versions.count(1)
    assert len(ref) == 5 and 0 < swapped < sum(len(t[0]) for t in ref)  # both versions sampled tokens


def _greedy_under_versions(old, new, prompt, tokens, versions):
    """HF's greedy tokens and full-forward log-probs for a sequence sampled greedily under version 0 and then,
    after a recompute swap, version 1."""
    cut = versions.index(1) if 1 in versions else len(tokens)
    hf = hf_greedy(old, prompt, cut) if cut else []
    hf += hf_greedy(new, prompt + tokens[:cut], len(tokens) - cut) if cut < len(tokens) else []
    ref = full_forward_logprobs(old, prompt, tokens)[:cut] + full_forward_logprobs(new, prompt, tokens)[cut:]
    return hf, ref
