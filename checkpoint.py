"""Checkpoints: written atomically, found by `resume=auto`, checked against the config, replayed exactly once.

Layout (one directory per checkpoint, only the highest one with a COMPLETE marker counts):

    runs/<run>/checkpoints/step_<N>/model/            HF directory: safetensors + config + tokenizer
                                   train_rank<R>.pt    every train rank: Trainer.checkpoint_state() (fp32 master
                                                       shard + AdamW state + step) and its RNG states
                                   state.json          the head: resolved config, buffer (completed groups and the
                                                       groups in flight, re-queued on resume), data position,
                                                       version, W&B id, byte sizes of metrics.jsonl / ledger.jsonl
                                   COMPLETE            written last; then .tmp_step_<N> is renamed to step_<N>

Writing is a train-group collective: the head creates `.tmp_step_<N>`, every train rank writes its shard, a barrier,
then the head writes the rest, fsyncs, marks COMPLETE and renames. A crash at any point leaves the previous
checkpoint intact (a stale `.tmp_*` is removed by the next save).

Exactly-once across restarts: the head records how many bytes metrics.jsonl and ledger.jsonl had when the checkpoint
was taken; on resume both files are truncated to those sizes, so lines written for steps after the checkpoint (and
then lost with the crash) disappear before the same steps are trained again. Groups that were in flight are
re-queued and re-admitted at the resumed version, so the staleness bound holds for them as for any new group.
Rollout ranks keep no state worth saving: their sampling seeds are a function of (seed, group, sample), and they
receive the checkpoint's weights through the head's first weight sync.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import torch

from config import Config, mismatched_keys, to_dict
from errors import HexrlError
from runlog import LOGS, RunLog, run_directory

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(HexrlError, ValueError):
    """A checkpoint is missing, incomplete, or does not match this run."""


# ---------------------------------------------------------------------------------------------- finding
def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and (d / MARKER).exists():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_complete(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def find_resume(cfg: Config) -> Path | None:
    """The checkpoint named by `checkpoint.resume`: "" -> None; a path -> that checkpoint (must be complete);
    "auto" -> the latest complete checkpoint of runs/<logging.run_name>, or, without a run name, of the most
    recent run of the same config (runs/<config>-<timestamp>) that has one; None when there is none yet."""
    spec = cfg.checkpoint.resume
    if not spec:
        return None
    if spec != "auto":
        path = Path(spec)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume '{spec}' is not a directory")
        if not (path / MARKER).exists():
            raise CheckpointError(
                f"checkpoint '{spec}' is incomplete (no {MARKER} marker); "
                f"the latest complete one is {latest_complete(path.parent.parent)}"
            )
        return path
    runs = Path(cfg.logging.run_dir)
    if cfg.logging.run_name:
        return latest_complete(runs / cfg.logging.run_name)
    candidates = sorted(runs.glob(f"{cfg.config_name}-*")) if runs.is_dir() else []
    for run in reversed(candidates):  # timestamped names sort by start time
        found = latest_complete(run)
        if found is not None:
            return found
    return None


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def load_head_state(checkpoint: Path, cfg: Config) -> dict:
    """The head's state.json, after checking that the checkpoint was written under the same config."""
    state = json.loads((checkpoint / "state.json").read_text())
    keys = mismatched_keys(state["config"], to_dict(cfg))
    if keys:
        flat = [f"{k} (checkpoint {_lookup(state['config'], k)!r}, now {_lookup(to_dict(cfg), k)!r})" for k in keys]
        raise CheckpointError(f"checkpoint {checkpoint} was written with a different config: {', '.join(flat)}")
    return state


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------- every train rank
def save_train_shard(trainer, directory: Path, rank: int) -> None:
    path = Path(directory) / f"train_rank{rank}.pt"
    torch.save({"trainer": trainer.checkpoint_state(), "rng": rng_state()}, path)
    _fsync_file(path)


def load_train_shard(trainer, checkpoint: Path, rank: int, num_train_ranks: int) -> None:
    saved = sorted(checkpoint.glob("train_rank*.pt"))
    if len(saved) != num_train_ranks:
        raise CheckpointError(
            f"checkpoint {checkpoint} has {len(saved)} train shards but this launch has "
            f"{num_train_ranks} train ranks (resume needs the same train layout)"
        )
    path = checkpoint / f"train_rank{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint {checkpoint} has no shard for train rank {rank}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    weights = None
    if state["trainer"]["model"] is None:  # a DP rank > 0: the weights are in its DP rank 0's shard
        peer = checkpoint / f"train_rank{trainer.groups.dp_ranks[0]}.pt"
        if not peer.exists():
            raise CheckpointError(f"checkpoint {checkpoint} has no shard for train rank {trainer.groups.dp_ranks[0]}")
        weights = torch.load(peer, map_location="cpu", weights_only=True)["trainer"]["model"]
    try:
        trainer.load_checkpoint_state(state["trainer"], weights)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    set_rng_state(state["rng"])


# ---------------------------------------------------------------------------------------------- the train head
class CheckpointWriter:
    """Head side of a checkpoint: temp dir, HF model, state.json, marker, rename, pruning."""

    def __init__(self, run_dir: Path, keep: int, tokenizer, hf_config):
        self.root = Path(run_dir) / CHECKPOINTS
        self.keep, self.tokenizer, self.hf_config = keep, tokenizer, hf_config

    def begin(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp_step_{step}"
        if tmp.exists():  # left by a crash mid-write
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def finish(self, tmp: Path, step: int, state_dict: dict[str, torch.Tensor], head_state: dict) -> Path:
        from huggingface_hub import save_torch_state_dict

        model_dir = tmp / "model"
        model_dir.mkdir()
        save_torch_state_dict(state_dict, model_dir, max_shard_size="5GB", safe_serialization=True)
        self.hf_config.save_pretrained(model_dir)
        self.tokenizer.save_pretrained(model_dir)
        (tmp / "state.json").write_text(json.dumps(head_state))
        _fsync_tree(tmp)
        (tmp / MARKER).write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        _fsync_file(tmp / MARKER)
        final = self.root / f"step_{step}"
        if final.exists():  # from a timeline abandoned by resuming an older checkpoint
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self.prune()
        return final

    def prune(self) -> None:
        if self.keep > 0:
            for _, d in complete_checkpoints(self.root.parent)[: -self.keep]:
                shutil.rmtree(d, ignore_errors=True)


def retire_checkpoints_after(run_dir: Path, step: int) -> list[Path]:
    """Resuming from step N: later checkpoints belong to an abandoned timeline (their ledger lines are being
    truncated), so they lose their step_ name and can never be picked by resume=auto."""
    retired = []
    for s, d in complete_checkpoints(Path(run_dir)):
        if s > step:
            target = d.with_name(f"abandoned_step_{s}_{int(time.time())}")
            os.rename(d, target)
            retired.append(target)
    return retired


def truncate_logs(run_dir: Path, sizes: dict[str, int]) -> dict[str, int]:
    """Cut metrics.jsonl / ledger.jsonl back to their sizes at the checkpoint; returns the bytes dropped."""
    dropped = {}
    for name, size in sizes.items():
        path = Path(run_dir) / name
        have = path.stat().st_size if path.exists() else 0
        if have < size:
            raise CheckpointError(
                f"{path} has {have} bytes but the checkpoint recorded {size}: "
                "the run directory does not belong to this checkpoint"
            )
        if have > size:
            with open(path, "r+b") as f:
                f.truncate(size)
                f.flush()
                os.fsync(f.fileno())
        dropped[name] = have - size
    return dropped


# ---------------------------------------------------------------------------------------------- durability
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync_file(Path(dirpath) / f)
        _fsync_dir(Path(dirpath))


def open_run(cfg: Config, checkpoint: Path | None, state: dict | None, plan: dict) -> RunLog:
    """The run directory and its logs; on resume, logs are cut back to the checkpoint (exactly once)."""
    if checkpoint is not None:
        run_dir = run_dir_of(checkpoint)
        dropped = truncate_logs(run_dir, state["log_sizes"])
        retired = retire_checkpoints_after(run_dir, state["version"])
        print(
            f"hexrl: resuming from {checkpoint} (step {state['version']}); dropped {dropped} bytes of log "
            f"written after it; set aside later checkpoints {[p.name for p in retired]}",
            flush=True,
        )
        return RunLog(cfg, run_dir, plan, step_offset=state["version"], wandb_id=state["wandb_id"])
    run_dir = run_directory(cfg)
    if cfg.checkpoint.resume == "auto":  # a crash before the first checkpoint: start the logs again
        truncate_logs(run_dir, {name: 0 for name in LOGS})
    return RunLog(cfg, run_dir, plan)
