import tempfile

import pytest
import torch.distributed as dist
from tiny import build_tiny_model


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
