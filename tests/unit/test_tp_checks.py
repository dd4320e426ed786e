"""Tensor parallelism's checks in process: gpu_options compiles under TP as without it, and the divisibility and
family checks are one error for the generator and the trainer (real TP-2 ranks: tests/dist/test_generator_tp.py,
tests/dist/test_parallel_ranks.py)."""

import pytest
import torch
from test_generator import make_model

from generator import Generator, gpu_options
from model_family import ModelFamilyError, check_tp_divides
from parallel.stage import Stage


def test_gpu_options_compile_a_tp_replica_as_any_other():
    """A TP replica's step holds its collectives (functional collectives: tests/dist/test_generator_tp.py runs a
    compiled TP-2 step), so the options take no TP degree: compiled on a GPU unless asked not to, on CPU if asked."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gpu_options(cuda)["compile_decode"] and not gpu_options(cpu)["compile_decode"]
    assert gpu_options(cpu, compile_decode="always")["compile_decode"]
    assert not gpu_options(cuda, compile_decode="never")["compile_decode"]
    # a compiled step carries packed prefill rows (ride_tokens); an eager one leaves the Generator's default
    assert gpu_options(cuda, ride_tokens=64)["ride_tokens"] == 64 and gpu_options(cpu)["ride_tokens"] is None


def test_divisibility_and_family_checks_are_one_error_for_the_generator_and_the_trainer():
    llama = make_model("llama")
    for tp, what in ((4, "num_key_value_heads=2"), (3, "num_attention_heads=4")):
        with pytest.raises(ModelFamilyError, match=f"tp={tp} must divide {what}"):
            check_tp_divides(llama.config, tp)
    llama.config.model_type = "gpt2"
    for build in (lambda: Generator(llama, max_batch_size=1, max_seq_len=8), lambda: Stage(llama, (0, 1), True, True)):
        with pytest.raises(ModelFamilyError, match="'gpt2' is not supported .*llama, qwen2, qwen3, mistral"):
            build()
