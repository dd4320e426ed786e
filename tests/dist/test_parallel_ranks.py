"""The trainer's parallel pieces on real gloo ranks against one process: the multi-rank equivalence run (torchrun,
4 ranks, 7 layouts x {Qwen2 tied+bias, Llama GQA, Qwen3 q/k norms, Mistral sliding window} against the 1-process reference) and vocab-parallel log-probs /
entropy (2 ranks) against the full-vocab version, values and gradients."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# dp > 1 shards with FSDP2; "allreduce": the same layout without it (train.shard_state=false)
LAYOUTS = "2,1,1:4;1,2,1:4;1,1,2:3+1;2,2,1:4;1,2,2:1+3;2,1,2:2+2;2,1,2:2+2:allreduce"
MODELS = ("qwen2", "llama", "qwen3", "mistral")  # every family of model_family.py


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    """One torchrun launch of tests/support/dist_parallel_worker.py: every layout x model, and the vocab-parallel
    check on two of its ranks. (the launch's completed process, the folder of the vocab-parallel errors)"""
    out = tmp_path_factory.mktemp("vocab-parallel")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
    }
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--nproc_per_node=4",
        "--standalone",
        os.path.join(ROOT, "tests", "support", "dist_parallel_worker.py"),
        "--layouts",
        LAYOUTS,
        "--models",
        ",".join(MODELS),
        "--vocab-parallel-out",
        str(out),
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out (hang?); output tail:\n{(e.stdout or '')[-3000:]}")
    return proc, out


def test_layouts_match_single_process_reference(parallel_run):
    proc = parallel_run[0]
    results = re.findall(r"RESULT \w+ rank=\d+ [^\n]*?(?=RESULT|\n|$)", proc.stdout)
    failed = [l for l in results if "FAIL" in l]
    assert proc.returncode == 0 and not failed, "\n".join(failed) or (proc.stdout + proc.stderr)[-4000:]
    # every layout x model reported its checks: head has gather x2 + params; every train rank loss/grads/step_loss
    for model in MODELS:
        for layout in LAYOUTS.split(";"):
            dims, split, *mode = layout.split(":")
            dp, tp, pp = dims.split(",")
            tag = f"{model} dp={dp} tp={tp} pp={pp} layers={split}" + (f" {mode[0]}" if mode else "")
            got = [l for l in results if tag + " " in l and (mode or " allreduce " not in l)]
            n_train = int(dp) * int(tp) * int(pp)
            assert len(got) == 2 + 3 * n_train, (tag, got)
    # the Llama case trains with a sequence-level mask that really drops sequences (checked on every rank)
    for model in ("llama", "mistral"):  # the models that train with it
        assert len([r for r in results if f"{model} mis-geo drops some sequences" in r and "PASS" in r]) == 4, results


def test_vocab_parallel_matches_full_vocab(parallel_run):
    proc, out = parallel_run
    for rank in range(2):
        assert os.path.exists(os.path.join(out, f"{rank}.pt")), (proc.stdout + proc.stderr)[-4000:]
        err = torch.load(os.path.join(out, f"{rank}.pt"), weights_only=True)
        assert err["lp"] < 1e-5 and err["ent"] < 1e-5 and err["grad"] < 1e-5, err
        assert err["chunked"] <= 1e-6 and err["chunked_grad"] <= 1e-6, err
