"""What the planner reads from real processes, measured here on gloo ranks: exp/estimate_memory.py against the peaks
of real CPU runs (FSDP and TP ranks, spawned), device_profile's co-load peers (processes that decode or train until
stopped), and a throttled 2-stage 1F1B pipeline that keeps the emulated devices' bubble."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
from test_emulation import cpu_busy
from tiny import ROOT

sys.path.insert(0, str(ROOT / "exp"))

from cpu_bench.emulation import Emulation, Throttle  # noqa: E402
from planner import (
    memory,  # noqa: E402
    specs,  # noqa: E402
)

within = memory.validation_ok  # within 15% of the measured lower bound, not above the upper bound by more than that


def test_estimate_within_15_percent_of_measured_peak_two_models_two_layouts():
    """Real CPU runs (gloo, the profiler's allocation records) vs the estimator in the same processes: a tied Qwen2
    under FSDP over 2 DP ranks, an untied GQA Llama over 2 TP ranks, and a rollout rank each time."""
    rows = memory.validate([("qwen2", "dp2"), ("llama", "tp2")], full_batch=False)
    assert len(rows) == 6 and {r["role"] for r in rows} == {"train", "rollout"}
    bad = [r for r in rows if not within(r)]
    assert not bad, memory.format_validation(rows)
    # the kinds add up, and the FSDP ranks hold exactly their half of AdamW's two fp32 moments (and its step counts)
    qwen = memory.VALIDATION_MODELS["qwen2"]
    spec = specs.model_from_config(qwen)
    for r in rows:
        assert sum(r["kinds"][k] for k in memory.KINDS) == r["estimated"]
        if r["model"] == "qwen2" and r["role"] == "train":
            steps = r["kinds"]["optimizer"] - 2 * 4 * spec.params // 2  # AdamW's fp32 step counter per tensor
            assert 0 < steps <= 4 * 64, r["kinds"]
            assert r["kinds"]["weights"] >= 4 * spec.params // 2 and r["kinds"]["logits"] > 0
        if r["role"] == "rollout":
            assert r["kinds"]["kv"] > 0 and r["kinds"]["grads"] == r["kinds"]["optimizer"] == 0


def test_co_load_peers_decode_until_stopped_and_a_peer_that_fails_is_one_error():
    """cpu_bench/co_load.start_peers: two peers decode and three train -- a DP pair in lockstep (both leave at the
    same step) and one alone -- each reporting its steps when stopped; a peer that cannot build its model stops the
    start at once with one error naming it, and no peer is left."""
    import time

    from cpu_bench import co_load
    from planner import device_profile

    logged = []
    load = co_load.start_peers(
        5, device_profile.NULL_MODEL, (2, 8, 4), None, logged.append, trainers=3, train=((4, 8, 8), 64)
    )
    time.sleep(2.0)
    procs, tmp = list(load.procs), load.tmp
    steps = load.close()
    assert len(steps) == 5 and all(n > 0 for n in steps) and steps[0] == steps[1], steps  # the train peers too
    assert all(not p.is_alive() for p in procs)
    assert "3 training in DP pairs, 2 decoding 2 rows" in logged[-1] and not os.path.exists(tmp)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"co-load of 1 peer processes: peers \[0\] exited"):
        co_load.start_peers(1, (64, 128, 1, 0, 1, 64), (2, 8, 4), None, lambda *_: None)  # 0 heads: no model
    assert time.monotonic() - t0 < 120  # not the start timeout's 300 s


def _pipeline_worker(rank: int, init_file: str, out_dir: str, m: int, cpu_s: float, fraction: float) -> None:
    """One stage of a 2-stage 1F1B pipeline (parallel/pipeline.py) whose every forward costs `cpu_s` of CPU time,
    on an emulated type of compute `fraction`, the waits on the other stage hooked to the throttle as the trainer's
    are (cpu_bench.wrap_rank). Writes this stage's seconds for the whole pipeline."""
    import torch
    import torch.distributed as dist

    from parallel.pipeline import StageLinks, train_1f1b

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    throttle = Throttle(Emulation(compute=fraction))
    links = StageLinks(None if rank == 0 else 0, 1 if rank == 0 else None, None, torch.device("cpu"))
    links.waiting = throttle.waiting
    weight = torch.ones(4, requires_grad=True)

    def step(i: int, x):
        cpu_busy(cpu_s)
        return weight.reshape(1, 1, 4) * 1.0 if x is None else (x.reshape(4) * weight).sum()

    train_1f1b(links, m, lambda i: (1, 1, 4), step, rank, 2)  # unthrottled, to connect the pair before timing
    dist.barrier()
    t0 = time.perf_counter()
    with throttle.piece("compute"):
        train_1f1b(links, m, lambda i: (1, 1, 4), step, rank, 2)
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps({"seconds": time.perf_counter() - t0}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.alone  # a ratio of wall times
def test_a_throttled_pipeline_runs_the_emulated_devices_1f1b_not_one_pad_at_the_end(tmp_path):
    """Two stages of one emulated type, m = 2 micro-batches whose forward costs t = cpu / fraction on the device:
    the second stage cannot start until the first's first forward is done, so the pipeline takes (m + 1) t, as on
    the device (cost_model.train_step_times: sum_k t_k + (m - 1) max_k t_k). Padded once at the end of the step
    instead, each stage would run at this machine's speed and the pipeline would take m t: the bubble hidden."""
    import torch.multiprocessing as mp

    m, cpu_s, fraction = 2, 0.03, 0.25
    t = cpu_s / fraction
    mp.spawn(_pipeline_worker, args=(str(tmp_path / "init"), str(tmp_path), m, cpu_s, fraction), nprocs=2)
    last = json.loads((tmp_path / "1.json").read_text())["seconds"]
    assert last == pytest.approx((m + 1) * t, rel=0.15), last
