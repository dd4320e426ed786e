"""RunLog with W&B actually on (offline): the default config logs to W&B offline, while CI disables W&B for
speed everywhere else -- this is the test that runs the W&B path a new user gets."""

import json

from config import load_config
from runlog import RunLog, run_directory


def test_wandb_offline_run_logs_metrics_and_keeps_its_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config([f"logging.run_dir={tmp_path}", "logging.run_name=wb", "logging.progress=false"])
    run_dir = run_directory(cfg)
    log = RunLog(cfg, run_dir, {"world_size": 1})
    try:
        assert log.wandb is not None and log.wandb_id and log.wandb.id == log.wandb_id
        first_id = log.wandb_id
        log.step({"step": 1, "version": 1, "reward_mean": 0.5, "loss": float("nan")})
        log.step({"step": 2, "version": 2, "reward_mean": 0.6, "loss": 0.1})
        # the rollout ranks' eval of version 1 reports after step 2: W&B must keep it (it drops a log whose
        # step goes back, so every metric is plotted against the logged trainer_step instead)
        log.eval_result(1, 0.25, 8)
        assert log.wandb.summary["eval_accuracy"] == 0.25 and log.wandb.summary["trainer_step"] == 1
    finally:
        log.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward_mean"] == 0.5 and rows[0]["loss"] is None  # strict JSON: NaN -> null
    assert rows[-1]["step"] == 1 and rows[-1]["eval_accuracy"] == 0.25
    offline_runs = [d for d in (run_dir / "wandb").iterdir() if d.name.startswith("offline-run-")]
    assert offline_runs and any(first_id in d.name for d in offline_runs)
    # a resume passes the checkpointed id back: the same W&B run continues
    log = RunLog(cfg, run_dir, {"world_size": 1}, step_offset=1, wandb_id=first_id)
    try:
        assert log.wandb_id == first_id and log.wandb.id == first_id
    finally:
        log.close()
