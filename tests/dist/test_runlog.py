"""RunLog with W&B actually on (offline): the default config logs to W&B offline, while CI disables W&B for
speed everywhere else -- this is the test that runs the W&B path a new user gets."""

import json
from pathlib import Path

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


def test_check_run_names_every_failed_check(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_run", Path(__file__).parents[2] / "exp" / "check_run.py")
    check_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_run)

    def write(ledger_extra=(), accs=(0.2, 0.5), oldest=(0, 1)):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        config = {"staleness": {"max_staleness": 0}, "train": {"prompts_per_step": 1}}
        (run / "config.yaml").write_text(json.dumps({**config, "rollout": {"samples_per_prompt": 1}}))
        metrics = [{"step": 0, "eval_accuracy": accs[0]}]
        metrics += [
            {"step": s, "time": s, "loss": 0.1, "importance_weight_mean": 1.01, "staleness_max": 0} for s in (1, 2)
        ]
        metrics += [{"step": 2, "eval_accuracy": accs[1]}]
        ledger = [
            {"group_id": g, "sample_idx": 0, "min_version": v, "max_version": s - 1, "trainer_version": s - 1}
            | {"step": s, "updated": True}
            for g, s, v in ((0, 1, oldest[0]), (1, 2, oldest[1]))
        ] + list(ledger_extra)
        (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ledger))
        return str(run)

    good = write()
    assert check_run.main([good, "--eta", "0", "--min-gain", "30", "--weights-near-one", "0.02"]) == 0
    assert check_run.main([good, "--eta", "0", "--min-gain", "31"]) == 1  # 30 points gained
    assert check_run.main([good, "--eta", "0", "--weights-near-one", "0.005"]) == 1
    twice = {"group_id": 0, "sample_idx": 0, "min_version": 1, "max_version": 1, "trainer_version": 1, "step": 2}
    bad = write([twice | {"updated": True}])
    assert check_run.main([bad]) == 1  # consumed twice (its group no longer whole, 3 trained for 2 steps)
    stale = write(oldest=(0, 0))
    assert check_run.main([stale]) == 1  # one token a version old under the run's own bound 0
    assert check_run.main([good, "--eta", "0", "--min-steps", "3"]) == 1
