"""The tiers are folders: unit/ (one process, no subprocess), compiled/ (torch.compile'd steps: inductor runs a C++
compiler), dist/ (worker processes the test starts: gloo ranks, math-verify scorers, W&B's service), e2e/ (entry points run as processes: torchrun train.py, the CLIs, exp
scripts), gpu/ (CUDA only). `pytest tests` runs them all; any folder or file runs alone from the repository root."""

import compileall
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
# support/ holds tiny.py and the workers; unit/'s model builders and checks are reused by the dist and gpu tiers
sys.path[:0] = [str(p) for p in (TESTS / "support", TESTS / "unit") if str(p) not in sys.path]

from tiny import build_tiny_model  # noqa: E402  (tiny puts the repository and exp/ on sys.path)

pytest_plugins = ["cputime", "alone"]  # --cpu-durations=N; @pytest.mark.alone

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # the cores are shared by the workers: no thread waits for another's
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_sessionstart(session):
    """The suite starts a few hundred Python processes (ranks, CLIs): compiled once here, the repository's modules
    load as bytecode in each, where PYTHONDONTWRITEBYTECODE=1 (as on CI) would have every process compile them."""
    if not hasattr(session.config, "workerinput"):  # the xdist controller, or a run without xdist
        root = TESTS.parent
        for d in (root, root / "parallel", root / "planner", root / "cpu_bench", root / "exp", TESTS / "support"):
            compileall.compile_dir(d, maxlevels=0, quiet=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def world_of_one():
    """torch.distributed with one gloo rank, for code that calls collectives or dist.get_rank()."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        yield
        dist.destroy_process_group()
