"""Helpers shared by tests: a tiny random-init Llama with our tokenizer, saved as an HF directory."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "exp"))

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    # the repo first, then whatever the caller had (gpu_check.sh puts carried wheels there)
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    "OMP_NUM_THREADS": "1",
}


def build_tiny_model(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    import make_tiny_model
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks import arith_splits, format_prompt, problem_from_row, worked_solution

    rows = arith_splits(600, 10, seed)[0]
    rng = random.Random(seed)
    tok = make_tiny_model.train_tokenizer(
        [format_prompt(r["question"]) + worked_solution(problem_from_row(r), rng, 0.5) for r in rows], 400
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=(len(tok) + 7) // 8 * 8,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def torchrun(nproc: int, args: list[str], timeout: float = 240, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        "train.py",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
