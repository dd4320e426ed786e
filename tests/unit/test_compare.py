"""exp/compare.py on synthetic run directories: table values, grouping, plots, W&B adapter, bad input."""

from __future__ import annotations

import json
import math

import compare  # exp/ is on sys.path via tests/support/tiny.py (conftest imports it)
import pytest
import yaml


def write_run(
    root,
    name: str,
    eta: int,
    steps: list[dict],
    evals: list[tuple[int, float, float]],
    ledger: list[tuple[int, int]] | None = None,
):
    """A run dir as runlog.py writes it; `evals` are (step, time, accuracy); `ledger` (trainer_version, min_version)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"staleness": {"max_staleness": eta}, "train": {"lr": 1e-4}}))
    lines = [{"time": t, "step": s, "eval_accuracy": a, "eval_n": 10} for s, t, a in evals]
    lines += [{"time": 1.0 + i, "loss": 0.1, **rec} for i, rec in enumerate(steps)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if ledger is not None:
        (d / "ledger.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "prompt_id": 0,
                        "group_id": 0,
                        "sample_idx": i,
                        "min_version": mv,
                        "max_version": mv,
                        "trainer_version": tv,
                        "step": tv + 1,
                    }
                )
                + "\n"
                for i, (tv, mv) in enumerate(ledger)
            )
        )
    return d


def step(k: int, tokens: float, step_s: float, stale_mean: float = 0.0, stale_max: int = 0, **extra) -> dict:
    return {
        "step": k,
        "trained_tokens": tokens,
        "step_s": step_s,
        "trained_tokens_per_s": tokens / step_s,
        "generated_tokens_per_s": 2 * tokens / step_s,
        "staleness_mean": stale_mean,
        "staleness_max": stale_max,
        "reward_mean": 0.1 * k,
        "weight_sync_s": 0.01 * k,
        "rollout_idle_frac": 0.5 / k,
        "trainer_idle_frac": 0.4 / k,
        "elapsed_s": float(k),
        **extra,
    }


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sweep"
    # eta0: warm-up step 1 is slow; steady state steps 2..3 give (100 + 300) / (1 + 3) = 100 tok/s
    write_run(
        root,
        "eta0",
        0,
        [step(1, 50, 10.0), step(2, 100, 1.0), step(3, 300, 3.0)],
        [(0, 0.5, 0.1), (3, 9.0, 0.3)],
        ledger=[(0, 0), (1, 1), (2, 2)],
    )
    # eta4: steady state (400 + 400) / (2 + 2) = 200 tok/s; best accuracy is not the last one
    write_run(
        root,
        "eta4",
        4,
        [step(1, 50, 10.0), step(2, 400, 2.0, 1.5, 2), step(3, 400, 2.0, 0.5, 3)],
        [(0, 0.5, 0.2), (2, 5.0, 0.6), (3, 9.0, 0.4)],
        ledger=[(1, 0), (2, 0), (2, 1), (2, 2)],
    )
    return root


def test_summary_values(sweep):
    runs = [compare.load_run_dir(p) for p in compare.find_run_dirs([str(sweep)])]
    assert [r.name for r in runs] == ["eta0", "eta4"]
    s0, s4 = (compare.summarize(r, warmup=1) for r in runs)
    assert s0["steps"] == 3 and s4["steps"] == 3
    assert s0["tokens_per_s"] == pytest.approx(100.0)
    assert s4["tokens_per_s"] == pytest.approx(200.0)
    assert s4["gen_tokens_per_s"] == pytest.approx(400.0)
    assert s0["step_s"] == pytest.approx(2.0) and s4["step_s"] == pytest.approx(2.0)
    assert (s0["final_acc"], s0["best_acc"]) == (pytest.approx(0.3), pytest.approx(0.3))
    assert (s4["final_acc"], s4["best_acc"]) == (pytest.approx(0.4), pytest.approx(0.6))
    assert s4["staleness_mean"] == pytest.approx(2.0 / 3) and s4["staleness_max"] == 3
    assert s4["rollout_idle"] == pytest.approx(0.5 / 3) and s4["trainer_idle"] == pytest.approx(0.4 / 3)
    assert s4["sync_s"] == pytest.approx(0.02)
    assert runs[1].staleness == [1, 2, 1, 0]
    # warmup=0 counts the slow first step too
    assert compare.summarize(runs[0], warmup=0)["tokens_per_s"] == pytest.approx(450 / 14)


def test_grouped_table_and_ratio(sweep, tmp_path):
    extra = write_run(tmp_path / "other", "eta4b", 4, [step(1, 50, 10.0), step(2, 600, 2.0)], [(2, 3.0, 0.2)])
    runs = [compare.load_run_dir(p) for p in compare.find_run_dirs([str(sweep), str(extra)])]
    for r in runs:
        compare.summarize(r)
    table = compare.format_table(runs, "staleness.max_staleness").splitlines()
    assert "x first" in table[0] and "staleness.max_staleness" in table[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [r[1] for r in rows] == ["0", "4"] and [r[2] for r in rows] == ["1", "2"]
    tok = table[0].strip("|").split("|").index(" tok/s ")
    assert float(rows[1][tok]) == pytest.approx((200 + 300) / 2)  # group mean over eta4 and eta4b
    assert float(rows[1][-1]) == pytest.approx(2.5)  # vs the eta=0 group's 100 tok/s
    assert rows[0][3] == "3" and rows[0][0] == "eta0"


def test_main_writes_table_and_pngs(sweep, capsys):
    assert compare.main([str(sweep), "--group-by", "staleness.max_staleness"]) == 0
    out = capsys.readouterr().out
    assert "| eta0" in out and "| eta4" in out
    names = {"reward_vs_time.png", "reward_vs_step.png", "throughput.png", "staleness.png"}
    for n in names:
        data = (sweep / "compare" / n).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    summary = json.loads((sweep / "compare" / "summary.json").read_text())
    assert summary["eta4"]["tokens_per_s"] == pytest.approx(200.0) and summary["eta4"]["group"] == 4


def test_run_without_steps_or_evals(tmp_path):
    d = write_run(tmp_path, "crashed", 0, [], [(0, 0.5, 0.0)])
    r = compare.load_run_dir(d)
    s = compare.summarize(r)
    assert s["steps"] == 0 and math.isnan(s["tokens_per_s"]) and s["final_acc"] == 0.0
    assert "| crashed" in compare.format_table([r])
    assert len(compare.make_plots([r], tmp_path / "plots")) == 4


def test_wandb_adapter_with_fake_api():
    class FakeRun:
        name, id = "w1", "abc"
        config = {"staleness": {"max_staleness": 2}, "_wandb": {"x": 1}}

        def scan_history(self):  # rows as RunLog logs them: the trainer step is a field, _step is W&B's counter
            yield {"_step": 0, "_runtime": 1.0, "trainer_step": 0, "time": 0.5, "eval_accuracy": 0.25}
            yield {"_step": 1, "trainer_step": 1, "time": 2.0, "loss": 0.1, **step(1, 10, 5.0)}
            yield {"_step": 2, "trainer_step": 2, "time": 3.0, "loss": 0.1, **step(2, 40, 2.0)}
            yield {"_step": 3, "trainer_step": 2, "time": 3.5, "eval_accuracy": 0.5}  # the eval reports late

    class LegacyRun(FakeRun):  # logged before trainer_step existed: W&B's _step was the trainer step
        name, id = "w0", "old"

        def scan_history(self):
            yield {"_step": 1, "time": 2.0, "loss": 0.1, **step(1, 10, 5.0), "eval_accuracy": 0.5}

    class FakeApi:
        def runs(self, path, filters=None):
            assert path == "ent/proj" and filters == {"state": "finished"}
            return [FakeRun(), LegacyRun()]

    run, legacy = compare.load_wandb_runs("ent/proj", {"state": "finished"}, api=FakeApi())
    assert [s["step"] for s in run.steps] == [1, 2] and [e["step"] for e in run.evals] == [0, 2]
    assert [s["step"] for s in legacy.steps] == [1] and [e["step"] for e in legacy.evals] == [1]
    assert compare.config_value(run.config, "staleness.max_staleness") == 2 and "_wandb" not in run.config
    s = compare.summarize(run)
    assert s["tokens_per_s"] == pytest.approx(20.0) and s["best_acc"] == 0.5


def test_bad_inputs(tmp_path, sweep, capsys):
    with pytest.raises(compare.CompareError, match="does not exist"):
        compare.find_run_dirs([str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(compare.CompareError, match="no run directories"):
        compare.find_run_dirs([str(tmp_path / "empty")])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.1}\n{"step": 1, "loss": \n')
    with pytest.raises(compare.CompareError, match=r"metrics.jsonl:2: not a JSON line"):
        compare.load_run_dir(bad)
    runs = [compare.load_run_dir(p) for p in compare.find_run_dirs([str(sweep)])]
    for r in runs:
        compare.summarize(r)
    with pytest.raises(compare.CompareError, match="'train.nope' is not in the config"):
        compare.format_table(runs, "train.nope")
    assert compare.main([]) == 2
    assert compare.main([str(sweep), "--group-by", "train.nope", "--no-plots"]) == 2
    assert "error: --group-by 'train.nope'" in capsys.readouterr().err
