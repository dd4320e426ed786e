"""Run directory, metrics.jsonl, the trajectory ledger, W&B and the progress bar (train head only).

runs/<run>/config.yaml     the resolved config          runs/<run>/plan.json     the rank map used
runs/<run>/metrics.jsonl   one line per step (+ eval lines with `eval_accuracy`)
runs/<run>/ledger.jsonl    one line per consumed trajectory: prompt_id, group_id, sample_idx,
                           min/max token version, trainer version, step, updated (false: a skipped
                           non-finite step) — audits exactly-once and staleness
Both files are append-only; `sizes()` is what a checkpoint records, so a resume can cut them back to it.
Non-finite floats are written as null (strict JSON).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections import Counter
from pathlib import Path

import yaml

from config import Config, to_dict

LOGS = ("metrics.jsonl", "ledger.jsonl")


def _finite_or_null(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def peak_memory_bytes() -> int:
    """This process's peak memory so far: on a GPU the CUDA allocator's peak on the current device, on CPU the
    peak resident set (ru_maxrss, KiB on Linux)."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_directory(cfg: Config) -> Path:
    name = cfg.logging.run_name or f"{cfg.config_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(cfg.logging.run_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


class RunLog:
    def __init__(self, cfg: Config, run_dir: Path, plan: dict, step_offset: int = 0, wandb_id: str | None = None):
        self.cfg, self.dir = cfg, run_dir
        resolved = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        print(f"hexrl run directory: {run_dir}\nresolved config:\n{resolved}", flush=True)
        (run_dir / "config.yaml").write_text(resolved)
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=1))
        self.metrics = open(run_dir / "metrics.jsonl", "a")
        self.ledger_file = open(run_dir / "ledger.jsonl", "a")
        self.t0 = time.monotonic()
        self.last_eval: float | None = None
        self.wandb = None
        mode = os.environ.get("WANDB_MODE", cfg.logging.wandb)
        if mode != "disabled":
            import wandb

            # our own id (wandb.util.generate_id is gone in wandb 0.31), kept in checkpoints so a resume continues
            # the same W&B run
            self.wandb_id = wandb_id or secrets.token_hex(4)
            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                name=run_dir.name,
                dir=str(run_dir),
                mode=mode,
                config=to_dict(cfg),
                id=self.wandb_id,
                resume="allow",
            )
            # Every metric is plotted against our trainer step, a logged field, not W&B's own step counter: an
            # eval of version v reports after steps > v were logged, and W&B drops a log whose step= went back.
            self.wandb.define_metric("trainer_step")
            self.wandb.define_metric("*", step_metric="trainer_step")
        else:
            self.wandb_id = wandb_id
        self.bar = None
        if cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.train.total_steps, initial=step_offset, desc="hexrl", unit="step", dynamic_ncols=True
            )

    def _write(self, record: dict) -> None:
        record = {"time": round(time.monotonic() - self.t0, 3), **{k: _finite_or_null(v) for k, v in record.items()}}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log(
                {"trainer_step": record["step"], **{k: v for k, v in record.items() if k != "step" and v is not None}}
            )

    def step(self, stats: dict) -> None:
        self._write(stats)
        if self.bar is not None:
            self.bar.update(stats["step"] - self.bar.n)
            post = {
                "reward": f"{stats['reward_mean']:.3f}",
                "acc": f"{stats['train_accuracy']:.2f}",
                "tok/s": f"{stats['trained_tokens_per_s']:.0f}",
            }
            if self.last_eval is not None:
                post["eval"] = f"{self.last_eval:.3f}"
            self.bar.set_postfix(post)

    def eval_result(self, version: int, accuracy: float, n: int) -> None:
        self.last_eval = accuracy
        self._write({"step": version, "eval_accuracy": accuracy, "eval_n": n})
        msg = f"eval @ step {version}: greedy accuracy {accuracy:.3f} on {n} held-out problems"
        (self.bar.write(msg) if self.bar is not None else print(msg, flush=True))

    def event(self, step: int, event: str, **info) -> None:
        """Faults the run survived (a rollout rank lost, ...): a metrics line with an `event` field."""
        self.metrics.write(
            json.dumps({"time": round(time.monotonic() - self.t0, 3), "step": step, "event": event, **info}) + "\n"
        )
        self.metrics.flush()

    def ledger(
        self, trajectories: list, trainer_version: int | None, step: int, updated: bool = True, dropped: str = ""
    ) -> None:
        """One line per consumed trajectory: trained at `trainer_version` in `step`, or `dropped` (dynamic
        sampling: trainer_version null) -- every admitted group appears exactly once."""
        for t in trajectories:
            self.ledger_file.write(
                json.dumps(
                    {
                        "prompt_id": t.prompt_id,
                        "group_id": t.group_id,
                        "sample_idx": t.sample_idx,
                        "min_version": min(t.versions, default=trainer_version),
                        "max_version": max(t.versions, default=trainer_version),
                        "trainer_version": trainer_version,
                        "step": step,
                        "updated": updated,
                        **({"dropped": dropped} if dropped else {}),
                    }
                )
                + "\n"
            )
        self.ledger_file.flush()

    def sizes(self) -> dict[str, int]:
        """Bytes in metrics.jsonl and ledger.jsonl now (everything is flushed after each write)."""
        return {"metrics.jsonl": self.metrics.tell(), "ledger.jsonl": self.ledger_file.tell()}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.metrics.close()
        self.ledger_file.close()
        if self.wandb is not None:
            self.wandb.finish()


def audit_run(run_dir: str | os.PathLike) -> dict:
    """What a finished run's logs show, and every way they break its guarantees (`problems`): step lines 1..N, each
    within the staleness bound; every trajectory consumed exactly once (unique (group_id, sample_idx), N x
    prompts_per_step x samples_per_prompt trained, each group whole), trained at version step - 1, no token older
    than eta, versions monotonic, no skipped (non-finite) step, no fault events. Also: the oldest token trained on,
    held-out accuracy first / last / best, the mean importance weight, the token-lag histogram. Used by
    exp/check_run.py and exp/real_model_report.py."""
    run = Path(run_dir)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    eta = cfg["staleness"]["max_staleness"]
    batch, group = cfg["train"]["prompts_per_step"], cfg["rollout"]["samples_per_prompt"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if m.get("eval_accuracy") is not None]
    events = [m["event"] for m in metrics if "event" in m]
    trained = [e for e in ledger if "dropped" not in e]
    keys = [(e["group_id"], e["sample_idx"]) for e in ledger]
    sizes = Counter(e["group_id"] for e in ledger)
    lags = [e["trainer_version"] - e["min_version"] for e in trained]
    problems = []
    if [m["step"] for m in steps] != list(range(1, len(steps) + 1)):
        problems.append(f"step lines {[m['step'] for m in steps][:10]}..., expected 1..{len(steps)}")
    problems += [
        f"step {m['step']}: staleness_max {m['staleness_max']} > eta {eta}" for m in steps if m["staleness_max"] > eta
    ]
    problems += [f"step {m['step']}: non-finite, update skipped" for m in steps if m.get("nonfinite_skipped")]
    if events:
        problems.append(f"fault events in the run: {events[:5]}")
    if len(keys) != len(set(keys)):
        twice = [k for k, n in Counter(keys).items() if n > 1]
        problems.append(f"{len(twice)} trajectories consumed more than once, e.g. {twice[:3]}")
    if len(trained) != len(steps) * batch * group:
        problems.append(f"{len(trained)} trained trajectories, expected {len(steps)} x {batch} x {group}")
    if any(n != group for n in sizes.values()):
        problems.append(f"groups not whole: {[g for g, n in sizes.items() if n != group][:5]}")
    for e in trained:
        if e["trainer_version"] != e["step"] - 1:
            problems.append(f"trained at version {e['trainer_version']} in step {e['step']}: {e}")
        if e["trainer_version"] - e["min_version"] > eta:
            problems.append(f"a token {e['trainer_version'] - e['min_version']} versions old > eta {eta}: {e}")
        if not e["min_version"] <= e["max_version"] <= e["trainer_version"]:
            problems.append(f"versions out of order: {e}")
    if [e["step"] for e in ledger] != sorted(e["step"] for e in ledger):
        problems.append("ledger steps not monotonic")
    weights = [m["importance_weight_mean"] for m in steps if m.get("importance_weight_mean") is not None]
    accs = [m["eval_accuracy"] for m in evals]
    return {
        "problems": problems[:20],
        "eta": eta,
        "steps": len(steps),
        "trajectories": len(ledger),
        "dropped": len(ledger) - len(trained),
        "groups": len(sizes),
        "staleness_max": max(lags, default=0),
        "lag_hist": dict(sorted(Counter(lags).items())),
        "eval_first": accs[0] if accs else None,
        "eval_last": accs[-1] if accs else None,
        "eval_best": max(accs) if accs else None,
        "importance_weight_mean": sum(weights) / len(weights) if weights else None,
        "train_seconds": steps[-1].get("time") if steps else None,
        "config": cfg,
        "step_lines": steps,
        "eval_lines": evals,
    }
