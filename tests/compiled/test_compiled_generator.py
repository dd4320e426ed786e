"""The generator's compiled step (compile_decode=True) on CPU: inductor compiles each graph with a C++ compiler in
processes of its own, so these run apart from the one-process unit tier. On a GPU the same step runs as CUDA graphs
(tests/gpu/test_gpu.py)."""

import dataclasses

from test_generator import (
    PROMPTS,
    check_a_tiny_pool_waits_and_preempts_with_the_same_outputs,
    check_compiled_step_writes_the_pool_in_place,
    check_decode_attention_reads_only_live_blocks,
    full_forward_logprobs,
    hf_greedy,
    make_model,
    mixed_requests,
    perturbed_state_dict,
    pool_is_empty,
    run_streaming,
)

from generator import Generator, SamplingParams

# One geometry (Mistral; 4 slots of 40 tokens in a pool of 10 blocks of 4) for the tests that allow it: they share
# their compiled graphs through inductor's cache, and each graph costs tens of CPU seconds to compile on a cold one.
MODEL = "mistral"  # sliding window: the static step's masks cover it too
POOL = dict(max_batch_size=4, max_seq_len=40, kv_block_size=4, kv_cache_tokens=40, kv_seq_tokens=8)


def test_compiled_decode_step_matches_hf_and_follows_weight_swaps():
    """compile_decode=True: the decode step under torch.compile (on GPU as CUDA graphs: tests/gpu/test_gpu.py), with
    static shapes -- every slot, the whole cache length -- and prefill rows packed into it. Greedy equals
    HF generate with slot refills, log-probs match the full forward, and update_weights mid-generation reaches
    the compiled step: later tokens are exactly the new weights' and carry the new version."""
    model = make_model(MODEL, seed=8)
    gen = Generator(model, compile_decode=True, **POOL)
    for prompt, out in zip(PROMPTS, gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))):
        assert out.token_ids == hf_greedy(model, prompt, 10)
        ref = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
    for i, p in enumerate(PROMPTS):
        gen.add_request(i, p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i))
    done = {}
    for _ in range(4):
        done.update((o.request_id, o) for o in gen.step())
    gen.update_weights(perturbed_state_dict(model, seed=2), version=1)
    while gen.num_unfinished():
        done.update((o.request_id, o) for o in gen.step())
    swapped = 0
    for i, p in enumerate(PROMPTS):
        out = done[i]
        cut = out.versions.index(1) if 1 in out.versions else len(out.token_ids)
        assert out.versions == [0] * cut + [1] * (len(out.token_ids) - cut)
        ref = full_forward_logprobs(model, p, out.token_ids)  # the model holds the new weights now
        assert max([abs(a - b) for a, b in zip(ref[cut:], out.logprobs[cut:])], default=0.0) < 1e-4
        swapped += len(out.token_ids) - cut
    assert swapped > 0


def test_compiled_step_carries_packed_prefill_rows_with_the_same_outputs():
    """compile_decode: new requests' prefill rows ride in the compiled decode step, packed (ride_tokens rows at
    static shapes, each reading its own sequence's blocks in the pool), in the widest bucket's graph; a chunk that
    does not fit runs as a prefill-only forward first. GRPO groups (prompts shared, the partial last prompt block
    written to every sharer) with blocks of 4, Mistral's window of 5 shorter than the prompts, a weight swap
    (recompute) and a pool that preempts: whatever the budget -- 0 (every chunk a prefill-only forward), 6 (some
    ride, some do not), the default -- the tokens equal the eager generator's, log-probs within 1e-5, and a full
    forward's within 1e-4."""
    prompts, params = mixed_requests(stop=None)
    prompts = prompts + [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]] * 3  # longer than a budget of 6
    params = params + [SamplingParams(temperature=1.0, max_new_tokens=9, seed=90 + i) for i in range(3)]
    new_weights = perturbed_state_dict(make_model(MODEL, seed=61), seed=62)
    ref_gen = Generator(make_model(MODEL, seed=61), **POOL)
    ref = run_streaming(ref_gen, prompts, params, swap=new_weights)
    stats = {}
    for budget in (0, 6, None):
        model = make_model(MODEL, seed=61)
        gen = Generator(model, compile_decode=True, ride_tokens=budget, **POOL)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            gen.add_request(i, p, sp)
        outs, calls, ride_widths = {}, 0, set()
        while gen.num_unfinished():
            rides = gen.stats.prefill_rides
            outs.update((o.request_id, o) for o in gen.step())
            if gen.stats.prefill_rides > rides:
                ride_widths.add(gen.decode_width)
            calls += 1
            if calls == 4:  # as run_streaming swaps the reference's weights
                gen.update_weights(new_weights, version=1)
        stats[budget] = dataclasses.replace(gen.stats)
        assert ride_widths <= {4} and pool_is_empty(gen)  # the widest bucket's graph, whatever the running slots
        for i in range(len(prompts)):
            assert outs[i].token_ids == ref[i].token_ids and outs[i].versions == ref[i].versions
            assert max(abs(a - b) for a, b in zip(outs[i].logprobs, ref[i].logprobs)) < 1e-5
    assert stats[0].prefill_rides == 0 and stats[0].prefill_forwards > 0
    assert stats[6].prefill_rides > 0 and stats[6].prefill_forwards > 0
    assert stats[None].prefill_rides > 0 and stats[None].prefill_forwards < stats[0].prefill_forwards
    assert stats[None].prefill_tokens_shared > 0 and stats[None].preemptions > 0 and stats[None].recompute_tokens > 0
    for i, prompt in enumerate(prompts):  # the model holds the new weights: tokens sampled after the swap
        cut = ref[i].versions.index(1) if 1 in ref[i].versions else len(ref[i].token_ids)
        full = full_forward_logprobs(model, prompt, ref[i].token_ids, temperature=params[i].temperature or 1.0)
        assert max([abs(a - b) for a, b in zip(full[cut:], outs[i].logprobs[cut:])], default=0.0) < 1e-4


def test_compiled_step_writes_the_kv_pool_in_place():
    """The compiled step (decode rows, and packed prefill rows riding in it) writes K/V into the pool's storage in
    place: the code inductor generates for it takes the pool as an input and never allocates a buffer of its shape.
    Written by index_copy_ into a layer's view of the storage, inductor functionalizes it into a copy of the whole
    pool for each layer's K and V, so a step costs as much as copying the pool 2 x layers times, whatever the batch."""
    check_compiled_step_writes_the_pool_in_place(make_model("mistral", seed=70), {})


def test_a_tiny_pool_makes_admission_wait_and_preempts_with_the_same_outputs():
    check_a_tiny_pool_waits_and_preempts_with_the_same_outputs(MODEL, compile_decode=True)


def test_decode_attention_reads_only_live_blocks():
    check_decode_attention_reads_only_live_blocks("llama", compile_decode=True)
