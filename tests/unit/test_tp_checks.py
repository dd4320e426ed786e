"""Tensor parallelism's checks in process: gpu_options compiles under TP as without it, and the divisibility check is shared
by the generator and the trainer, only the trainer refusing sliding windows (real TP-2 ranks:
tests/dist/test_generator_tp.py)."""

import pytest
import torch
from test_generator import make_model

from generator import gpu_options
from model_family import check_tp_divides
from parallel.tensor_parallel import check_model_supports_tp


def test_gpu_options_compiles_under_tp_as_without_it():
    """A TP replica's step holds its collectives (functional collectives: tests/dist/test_generator_tp.py runs a
    compiled TP-2 step), so the TP degree changes none of the options."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for device in (cuda, cpu):
        for mode in ("auto", "always", "never"):
            assert gpu_options(device, mode, tp=2) == gpu_options(device, mode, tp=1)
    assert gpu_options(cuda, tp=2)["compile_decode"] and not gpu_options(cpu, tp=2)["compile_decode"]
    assert gpu_options(cpu, compile_decode="always", tp=2)["compile_decode"]
    assert not gpu_options(cuda, compile_decode="never", tp=2)["compile_decode"]
    # a compiled step carries packed prefill rows (ride_tokens); an eager one leaves the Generator's default
    assert gpu_options(cuda, ride_tokens=64)["ride_tokens"] == 64 and gpu_options(cpu)["ride_tokens"] is None


def test_divisibility_check_is_shared_and_only_the_trainer_refuses_sliding_windows():
    mistral = make_model("mistral").config  # sliding_window=5
    check_tp_divides(mistral, 2)  # the generator's check: a window is fine
    with pytest.raises(ValueError, match="sliding-window"):
        check_model_supports_tp(mistral, 2)
    llama = make_model("llama").config
    check_model_supports_tp(llama, 2)
    for tp, what in ((4, "num_key_value_heads=2"), (3, "num_attention_heads=4")):
        for check in (check_tp_divides, check_model_supports_tp):
            with pytest.raises(ValueError, match=f"tp={tp} must divide {what}"):
                check(llama, tp)
