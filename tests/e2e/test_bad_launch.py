"""Bad input at launch: train.py run for real (plain python for config errors; torchrun with 2 ranks, concurrently,
for the rest) gives one clear `[rank R] error: ...` line, exit code 2, no traceback from hexrl code, nothing lost;
and exit_on_error gives each error type's exit code in a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tiny import ENV, ROOT


def our_traceback(stderr: str) -> list[str]:
    """The traceback lines through hexrl's own files, each with the line after it (torchrun's own ChildFailedError
    summary does not count): empty when there is none."""
    lines = stderr.splitlines()
    return [
        "\n".join(lines[i : i + 2])
        for i, line in enumerate(lines)
        if line.strip().startswith("File ") and str(ROOT) in line and "site-packages" not in line
    ]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "] error: " in line]


def start(args: list[str], nproc: int = 0, cwd: Path = ROOT) -> subprocess.Popen:
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"] if nproc else []
    return subprocess.Popen(
        [sys.executable, *launcher, "train.py", *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_config_errors_without_launcher():
    procs = {
        "unknown": start(["train.lrr=1e-5"]),
        "typed": start(["train.total_steps=many"]),
        "not_kv": start(["--fast"]),
    }
    expected = {
        "unknown": "[rank 0] error: unknown config key 'train.lrr'; did you mean 'train.lr'?",
        "typed": "[rank 0] error: config key 'train.total_steps' expects int, got 'many'",
        "not_kv": "[rank 0] error: argument '--fast' is not of the form key=value",
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, err[-2000:])
        assert err.strip().splitlines() == [expected[name]], (name, err[-2000:])


def test_launch_errors_under_torchrun(tmp_path, tiny_model_dir):
    """Each: exactly one error line (rank 0), torchrun fails, no hexrl traceback, nothing written to a run dir."""
    bad_plan = tmp_path / "plan8.json"
    from plan import make_train_plan

    bad_plan.write_text(json.dumps(make_train_plan(4, 1, 1, [(0, 2)], world_size=8)))
    bad_rows = tmp_path / "rows.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(6)]
    rows[3] = {"question": "What is 3+1?"}  # the answer field is missing
    bad_rows.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = [
        f"model.path={tiny_model_dir}",
        f"logging.run_dir={tmp_path / 'runs'}",
        "logging.run_name=r",
        "logging.progress=false",
        "dist.timeout_s=60",
    ]
    cases = {
        "world": ([f"plan={bad_plan}"], "rank map is for world_size=8 but torchrun started 2 ranks"),
        "roles": (["plan.num_rollout=2"], "plan.num_rollout=2 leaves no rollout or no train rank in a world of 2"),
        "model": (["model.path=/nonexistent/model-dir"], "model.path '/nonexistent/model-dir' does not exist"),
        "rows": ([f"data.task={bad_rows}", "data.on_bad_row=fail"], "row 4: missing field 'answer'"),
        "resume": (["resume=/nonexistent/step_4"], "checkpoint.resume '/nonexistent/step_4' is not a directory"),
    }
    procs = {}
    for name, (extra, _) in cases.items():
        procs[name] = start([*common[:2], f"logging.run_name={name}", *common[3:], *extra], nproc=2)
        time.sleep(1.0)  # stagger the rendezvous ports / imports a little
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        lines = error_lines(err)
        assert proc.returncode != 0, name
        assert len(lines) == 1 and lines[0].startswith("[rank 0] error: "), (name, err[-3000:])
        assert cases[name][1] in lines[0], (name, lines)
        assert not our_traceback(err), (name, our_traceback(err), err[-3000:])
        assert (
            not (tmp_path / "runs" / name / "ledger.jsonl").exists()
            or (tmp_path / "runs" / name / "ledger.jsonl").stat().st_size == 0
        ), name


def test_bad_plan_files_are_one_line(tmp_path, tiny_model_dir):
    """A plan that is unreadable, or readable but inconsistent (parallel/groups.py's checks), fails the same way on
    every rank: rank 0 reports it once, in the whole output of a 2-rank run, without a traceback."""
    from plan import make_train_plan

    not_json = tmp_path / "not_json.json"
    not_json.write_text('{"world_size": 2, "ranks": [')
    bad_role = make_train_plan(1, 1, 1, [(0, 2)], world_size=2)
    bad_role["ranks"][1]["role"] = "generate"
    bad_layout = make_train_plan(1, 1, 1, [(0, 2)], world_size=2)
    bad_layout["ranks"][1].update(role="train", dp=0, tp=0, pp=0, layers=[0, 2])  # 2 train ranks, dp*tp*pp = 1
    for name, plan in (("bad_role", bad_role), ("bad_layout", bad_layout)):
        (tmp_path / f"{name}.json").write_text(json.dumps(plan))
    cases = {
        "not_json": f"plan file '{not_json}' is not valid JSON",
        "bad_role": "plan rank roles must be 'train' or 'rollout', got {1: 'generate'}",
        "bad_layout": "plan has 2 train ranks but dp*tp*pp = 1*1*1 = 1",
    }
    procs = {}
    for name in cases:
        procs[name] = start(
            [
                f"model.path={tiny_model_dir}",
                f"logging.run_dir={tmp_path / 'runs'}",
                f"logging.run_name={name}",
                "logging.progress=false",
                "dist.timeout_s=60",
                f"plan={tmp_path / f'{name}.json'}",
            ],
            nproc=2,
        )
        time.sleep(1.0)
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        combined = out + err
        assert proc.returncode != 0, name
        assert combined.count(cases[name]) == 1, (name, combined[-3000:])
        lines = error_lines(combined)
        assert len(lines) == 1 and lines[0].startswith("[rank 0] error: ") and cases[name] in lines[0], (
            name,
            combined[-3000:],
        )
        assert not our_traceback(combined), (name, our_traceback(combined), combined[-3000:])


def run_exit_on_error(expr: str) -> subprocess.CompletedProcess:
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import train, errors; train.exit_on_error({expr})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_exit_on_error_prints_one_line_and_uses_the_errors_exit_code():
    lost = run_exit_on_error("train.RolloutRanksLost('finished without rollout rank(s) [1]')")
    assert lost.returncode == 3
    assert lost.stderr.strip().splitlines() == ["[rank 0] error: finished without rollout rank(s) [1]"]
    new = run_exit_on_error("type('NewConceptError', (errors.HexrlError,), {})('the thing is broken')")
    assert new.returncode == 2  # a new concept's error needs no edit in train.py
    assert new.stderr.strip().splitlines() == ["[rank 0] error: the thing is broken"]
