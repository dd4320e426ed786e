"""The GPU path (CUDA, bf16, CUDA graphs via torch.compile, NCCL world of one): skipped without a GPU.

Run on a GPU machine with `python -m pytest -q tests/gpu/test_gpu.py` (exp/gpu_check.sh runs it with the benchmarks).
fp32 on CUDA must meet the CPU suite's exactness bounds (TF32 stays off, torch's default for matmuls); bf16 is
checked against HF's own bf16 forward with a bound that bf16 rounding of the logits allows.
"""

import copy
import dataclasses
import tempfile

import pytest
import torch
import torch.distributed as dist
from test_generator import PROMPTS, full_forward_logprobs, hf_greedy, make_model, perturbed_state_dict

from generator import Generator, SamplingParams, gpu_options

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
torch._dynamo.config.cache_size_limit = 64  # a compiled Generator per test: each is one more compile of the step


# every model family eager; the compiled (CUDA-graph) step on the three attention variants (GQA, sliding window,
# q/k norms) -- each compile costs tens of seconds of the GPU's short lease
@pytest.mark.parametrize(
    "kind,compile_decode",
    [
        ("llama", False),
        ("qwen2", False),
        ("mistral", False),
        ("qwen3", False),
        ("llama", True),
        ("mistral", True),
        ("qwen3", True),
    ],
)
def test_fp32_on_cuda_matches_hf_generate_and_full_forward(kind, compile_decode):
    """Greedy equals HF generate token for token on CUDA; log-probs within 1e-4 of HF's full forward; slot
    refills and stop tokens included; the CUDA-graph decode step gives the same tokens as the eager one."""
    model = make_model(kind).to(CUDA)
    gen = Generator(model, max_batch_size=3, max_seq_len=40, compile_decode=compile_decode)
    free_run = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12))
    stop = free_run[0].token_ids[4]
    outs = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop]))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12, stop=stop), (prompt, out.token_ids)
        ref = full_forward_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    # sampled, temperature 0.8: log-probs after temperature over the full vocabulary
    sampled = gen.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=10, seed=3))
    for prompt, out in zip(PROMPTS, sampled):
        ref = full_forward_logprobs(model, prompt, out.token_ids, temperature=0.8)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_cuda_graph_decode_is_captured_and_follows_weight_swaps():
    """compile_decode on CUDA really replays CUDA graphs (no cudagraph skip), and an update_weights mid-generation
    reaches the graph: every later token's log-prob equals the new weights' full forward, with the new version."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = make_model("llama", seed=7).to(CUDA)
    gen = Generator(model, max_batch_size=4, max_seq_len=40, compile_decode=True)
    for i, p in enumerate(PROMPTS):
        gen.add_request(i, p, SamplingParams(temperature=1.0, max_new_tokens=14, seed=i))
    done = {}
    for _ in range(5):
        done.update((o.request_id, o) for o in gen.step())
    new_state = {k: v.to(CUDA) for k, v in perturbed_state_dict(model, seed=1).items()}
    gen.update_weights(new_state, version=1)
    while gen.num_unfinished():
        done.update((o.request_id, o) for o in gen.step())
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    swapped_after = 0
    for i, p in enumerate(PROMPTS):
        out = done[i]
        if 1 not in out.versions:
            continue
        cut = out.versions.index(1)
        assert out.versions == [0] * cut + [1] * (len(out.token_ids) - cut)
        ref = full_forward_logprobs(model, p, out.token_ids)  # the model now holds the new weights
        assert max(abs(a - b) for a, b in zip(ref[cut:], out.logprobs[cut:])) < 1e-4
        swapped_after += len(out.token_ids) - cut
    assert swapped_after > 0


@pytest.mark.parametrize("kind,compile_decode", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_bf16_on_cuda_agrees_with_hf_bf16_forward(kind, compile_decode):
    """bf16 weights and cache: each sampled token's log-prob is within 0.05 of HF's bf16 full forward (bf16 logits
    carry ~0.4% rounding), and every greedy token is HF's argmax up to that rounding."""
    model = make_model(kind, seed=3).to(CUDA, torch.bfloat16)
    gen = Generator(model, max_batch_size=3, max_seq_len=40, compile_decode=compile_decode)
    assert gen.k_cache[0].dtype == torch.bfloat16
    worst = 0.0
    for temperature in (1.0, 0.0):
        outs = gen.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=12, seed=11))
        for prompt, out in zip(PROMPTS, outs):
            ref = full_forward_logprobs(model, prompt, out.token_ids)
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, out.logprobs)))
            if temperature == 0:  # HF's best log-prob at each position: ours must be within rounding of it
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + out.token_ids], device=CUDA)).logits[0].float()
                best = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].max(-1).values.tolist()
                assert all(r >= b - 0.05 for r, b in zip(ref, best)), (prompt, out.token_ids)
    assert worst < 0.05, worst


def test_gpu_options_choose_cuda_graphs_on_gpu_only():
    assert gpu_options(CUDA)["compile_decode"] and not gpu_options(torch.device("cpu"))["compile_decode"]
    assert not gpu_options(CUDA, compile_decode="never")["compile_decode"]


@pytest.fixture
def nccl_world_of_one():
    with tempfile.TemporaryDirectory() as d:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{d}/init", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_on_cuda_matches_the_cpu_reference(nccl_world_of_one, dtype):
    """One PPO train_step on CUDA (NCCL group of one): fp32 equals the 1-process CPU reference within 1e-4
    (loss and parameters); bf16 autocast with fp32 master weights stays within bf16's error of it."""
    from dist_parallel_worker import TEMPERATURE, make_trajectories, reference, tiny_model, trainer_config

    from parallel.groups import build_groups
    from parallel.trainer import Trainer
    from plan import make_train_plan

    model = tiny_model("qwen2")
    cfg = trainer_config(
        lr=1e-3, eps=1e-6, grad_clip=1.0, ppo_minibatches=2, micro_batch_tokens=24, behav_imp_weight_cap=3.0
    )
    trajs = make_trajectories(model, 6, TEMPERATURE)
    groups = build_groups(make_train_plan(1, 1, 1, [(0, 4)]))
    trainer = Trainer(
        copy.deepcopy(model), groups, cfg, CUDA, temperature=TEMPERATURE, compute_dtype=getattr(torch, dtype)
    )
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in trainer.params.values())
    metrics = trainer.train_step(trajs)
    _, _, ref_losses, ref_after = reference(model, trajs, cfg)
    after = {n: t.cpu() for n, t in trainer.gather_full_state_dict().items()}
    if dtype == "float32":
        assert metrics["loss"] == pytest.approx(sum(ref_losses) / 2, rel=1e-4)
        for n, t in ref_after.items():
            assert (after[n] - t).norm() <= 1e-4 * t.norm(), n
    else:
        assert metrics["loss"] == pytest.approx(sum(ref_losses) / 2, rel=0.05, abs=0.02)
        for n, t in ref_after.items():
            assert (after[n] - t).norm() <= 2e-2 * t.norm(), n


def test_colocated_run_on_one_gpu(tmp_path):
    """config=gpu_single: a rollout and a train rank on this one GPU (gloo everywhere, weights handed over through
    CUDA IPC, each role capped at its memory fraction): a few steps, exactly once, within the staleness bound."""
    import json
    import subprocess
    import sys

    from tiny import ENV, ROOT

    args = ["config=gpu_single", f"logging.run_dir={tmp_path}", "logging.run_name=r", "train.total_steps=4"]
    args += ["train.max_train_seconds=0", "data.num_test=16", "logging.eval_every=2", "logging.progress=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ledger = [json.loads(line) for line in open(tmp_path / "r" / "ledger.jsonl")]
    assert len({(e["group_id"], e["sample_idx"]) for e in ledger}) == len(ledger) == 4 * 16 * 8
    assert all(e["trainer_version"] - e["min_version"] <= 4 for e in ledger)


def read_shared_slot(descriptor, queue) -> None:
    """A second process: map the owner's GPU slots through CUDA IPC and return slot 1's bytes."""
    from parallel.handover import open_slots

    reader = open_slots(descriptor, CUDA)
    queue.put(reader.slot(1, 1000).cpu().tolist())


def test_shared_slots_cross_processes_through_cuda_ipc():
    """dist.handover=shared on a GPU: another process maps the owner's slots by their IPC handle and reads exactly
    what the owner wrote (parallel/handover.py)."""
    import torch.multiprocessing as mp

    from parallel.handover import SharedSlots

    owner = SharedSlots(2, 1000, CUDA)
    data = (torch.arange(1000, device=CUDA) % 251).to(torch.uint8)
    owner.slot(0, 1000).zero_()
    owner.slot(1, 1000).copy_(data)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    reader = ctx.Process(target=read_shared_slot, args=(owner.descriptor, queue))
    reader.start()
    got = queue.get(timeout=300)
    reader.join(timeout=60)
    owner.close()
    assert reader.exitcode == 0 and got == data.cpu().tolist()


def test_weight_handover_on_one_gpu_wire_and_shared_are_bitwise():
    """The colocated hand-over of a small model from a train rank to a rollout rank on this GPU, over the wire
    (pinned host memory) and in shared memory (CUDA IPC): both leave the replica bitwise the trainer's weights."""
    import json
    import subprocess
    import sys

    from tiny import ENV, ROOT

    cmd = [sys.executable, "exp/bench_weight_sync.py", "--device", "cuda", "--replicas", "1", "--repeats", "2"]
    cmd += ["--bench-shape", "256,4,512,1024", "--handover", "wire,shared", "--out", "/tmp/bench_ws_gpu_test.pt"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    assert summary["bitwise"] and summary["shared_s"] > 0 and summary["faster_handover"] in ("wire", "shared")


@pytest.mark.parametrize("compile_decode", [False, True])
def test_flex_async_bucketed_decode_on_cuda_matches_the_gathered_sync_path(compile_decode):
    """The GPU decode path (compiled: as it ships on CUDA; eager: flex_attention compiled alone): FlexAttention over
    the live blocks in place, the host one step behind (async_decode), batch-size buckets; fp32: the same tokens as
    the gathered, synchronous, unbucketed eager path, log-probs within 1e-5 of it and 1e-4 of HF's forward, with stop tokens, mixed sampling
    settings (greedy, top-p, top-k), GRPO prompt sharing and a small pool that preempts."""
    from test_generator import mixed_requests, pool_is_empty, run_streaming

    model = make_model("mistral", seed=50).to(CUDA)  # GQA and a sliding window shorter than the sequences
    free = Generator(model, max_batch_size=4, max_seq_len=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=8)
    )
    prompts, params = mixed_requests(stop=free[0].token_ids[3])
    # sequences of up to four blocks of 16 (flex's smallest GPU tile) on a pool of five: it preempts
    params = [dataclasses.replace(p, max_new_tokens=p.max_new_tokens + 40) for p in params]
    if compile_decode:  # one sampler variant (top-p), so a graph per bucket only: compiles cost the GPU's lease
        params = [dataclasses.replace(p, temperature=1.0, top_p=0.9, top_k=-1) for p in params]
    pool = dict(kv_block_size=16, kv_cache_tokens=80, kv_seq_tokens=16)
    shipped = Generator(
        model, max_batch_size=4, max_seq_len=64, compile_decode=compile_decode, decode_attention="flex", **pool
    )
    assert shipped.async_decode and shipped.decode_buckets and shipped.buckets == [1, 2, 4]
    plain = Generator(
        model, max_batch_size=4, max_seq_len=64, decode_attention="gather", async_decode=False, decode_buckets=False
    )
    ours, ref = run_streaming(shipped, prompts, params), run_streaming(plain, prompts, params)
    for i, prompt in enumerate(prompts):
        assert ours[i].token_ids == ref[i].token_ids and ours[i].finish_reason == ref[i].finish_reason
        assert max(abs(a - b) for a, b in zip(ours[i].logprobs, ref[i].logprobs)) < 1e-5
        full = full_forward_logprobs(model, prompt, ours[i].token_ids, temperature=params[i].temperature or 1.0)
        assert max(abs(a - b) for a, b in zip(ours[i].logprobs, full)) < 1e-4
    assert shipped.stats.preemptions > 0 and pool_is_empty(shipped)
    assert not compile_decode or shipped.stats.prefill_rides > 0  # packed prefill rows in the CUDA graphs
    # blocks Triton cannot tile: flex is refused when asked for, and auto takes the gathered path
    with pytest.raises(ValueError, match="power of two >= 16"):
        Generator(model, max_batch_size=4, max_seq_len=64, decode_attention="flex", kv_block_size=4)
    assert Generator(
        model, max_batch_size=4, max_seq_len=64, compile_decode=True, kv_block_size=4
    ).decode_attention == ("gather")


def test_compiled_flex_step_writes_the_kv_pool_in_place():
    """The CUDA-graph step with FlexAttention and packed prefill rows (as it ships on a GPU) writes K/V into the
    pool in place: no pool-sized buffer in its generated code (on the H200 the copies of the whole pool per layer
    were ~73 of the 1.5B RL tail's 84 ms per step)."""
    from test_generator import check_compiled_step_writes_the_pool_in_place

    model = make_model("mistral", seed=70).to(CUDA)  # fp32: the full-forward check's 1e-4
    check_compiled_step_writes_the_pool_in_place(model, dict(kv_block_size=16, decode_attention="flex"))


def test_async_decode_steps_do_not_sync_with_the_device():
    """In steady decoding (no admissions, no weight swap) step() issues no synchronizing CUDA call: the inputs go
    over non_blocking from pinned memory, sampling stays on the device, and the host waits only on the previous
    step's copy event. torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call (item, tolist of a
    CUDA tensor, a pageable copy)."""
    model = make_model("llama", seed=51).to(CUDA)
    gen = Generator(model, max_batch_size=4, max_seq_len=64, compile_decode=False)
    assert gen.async_decode
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, seed=5)
    gen.generate(PROMPTS[:4], params)  # warm-up: compiles the flex kernel for this bucket
    for i, p in enumerate(PROMPTS[:4]):
        gen.add_request(i, p, params)
    for _ in range(3):  # admission and prefill (block-table edits) happen here
        gen.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            gen.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while gen.num_unfinished():
        gen.step()
