"""The planner's CLIs as a user runs them, each a process: `schedule.py` writes a valid plan (and its plot),
`schedule.py profile` measures a device (the runtime's Generator and Trainer, real 2-process TP and DP steps, an
emulated type under its throttle beside co-load peers), and every bad input -- to schedule.py, a profile, a cluster
or exp/estimate_memory.py -- is one line on stderr and exit code 2."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_profile import profile_doc, write
from test_schedule import check_plan, tiny_config
from tiny import ENV, ROOT

import schedule
from planner import profile_fit, specs

TINY = ROOT / "exp" / "tiny-model"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "schedule.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_cpu_cluster_cli_gives_valid_rank_map(tmp_path):
    model_dir = tiny_config(tmp_path)
    out = tmp_path / "plan.json"
    res = run_cli(
        "--cluster",
        "exp/clusters/cpu.yaml",
        "--model",
        str(model_dir),
        "--nproc",
        "3",
        "--prompts",
        "8",
        "--samples",
        "4",
        "--prompt-len",
        "32",
        "--gen-mean",
        "64",
        "--out",
        str(out),
        "--plot",
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads(out.read_text())
    check_plan(plan, specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 3), specs.load_model_spec(model_dir))
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert "tokens/s" in res.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--cluster", "exp/clusters/cpu.yaml", "--model", "deepseek-r1-distill-qwen-14b"], "memory"),
        (["--cluster", "exp/clusters/hetero_32.yaml", "--model", "qwen2.5-0.5b", "--budget", "3"], "budget"),
        (["--cluster", "exp/clusters/cpu.yaml", "--model", "qwen2.5-0.5b", "--nproc", "1"], "--nproc"),
        (["--cluster", "exp/clusters/cpu.yaml", "--model", "qwen2.5-0.5b", "--train-layout", "4,1,1"], "train-layout"),
        (["--cluster", "exp/clusters/cpu.yaml", "--model", "qwen2.5-0.5b", "--train-layout", "x"], "dp,tp,pp"),
        (["--cluster", "nope.yaml", "--model", "qwen2.5-0.5b"], "cluster spec not found"),
        (["--cluster", "exp/clusters/cpu.yaml", "--model", "no-such-model"], "model config not found"),
        (["--cluster", "exp/clusters/cpu.yaml", "--model", "qwen2.5-0.5b", "--eta", "-1"], "eta"),
    ],
)
def test_cli_errors_are_one_line(args, needle):
    res = run_cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


def test_a_forced_layout_that_does_not_fit_is_one_line_naming_the_rank():
    """The CLI side of unit/test_schedule.py::test_a_forced_layout_that_does_not_fit_names_the_rank_and_its_bytes."""
    res = run_cli("--cluster", "exp/clusters/h800_24.yaml", "--model", "deepseek-r1-distill-qwen-14b", "--train-layout",
                  "1,1,2", "--microbatch-tokens", "16384")  # fmt: skip
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "rank 0" in res.stderr


def test_rollout_tp_cli_plans_one_tp2_replica(tmp_path):
    out = tmp_path / "plan.json"
    args = "--cluster exp/clusters/cpu.yaml --model exp/tiny-model --nproc 4 --rollout-tp 2 --out".split()
    res = run_cli(*args, str(out))
    assert res.returncode == 0, res.stderr
    plan = json.loads(out.read_text())
    check_plan(
        plan, specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 4), specs.load_model_spec(ROOT / "exp/tiny-model")
    )
    assert sum(r["role"] == "train" for r in plan["ranks"]) == 2
    (rep,) = plan["rollout"]["replicas"]
    assert (rep["tp"], rep["pp"], len(rep["ranks"])) == (2, 1, 2)
    assert len({plan["ranks"][i]["machine"] for i in rep["ranks"]}) == 1
    assert not any(r.get("idle") for r in plan["ranks"])
    assert plan["inputs"]["rollout_tp"] == 2
    p, _ = schedule.planner_from_plan(plan)  # calibrate rebuilds the same replica space
    assert p.rollout_tp == 2 and {c.tp for c in p.replica_configs("cpu")} == {2}


@pytest.mark.parametrize(
    "nproc, k, needle",
    [
        ("4", "3", "--rollout-tp 3 does not divide the model tiny-model's attention heads (8), KV heads (4)"),
        ("4", "8", "KV heads (4), vocab size (388)"),  # 8 divides the 8 heads, but KV heads are not replicated
        ("3", "4", "--rollout-tp 4: no machine has 4 GPUs of one type"),
        ("4", "4", "role left empty"),  # one TP-4 replica takes the whole machine: no trainer left
        ("4", "0", "--rollout-tp must be >= 1"),
    ],
)
def test_rollout_tp_errors_are_one_line(nproc, k, needle):
    res = run_cli(
        "--cluster", "exp/clusters/cpu.yaml", "--model", "exp/tiny-model", "--nproc", nproc, "--rollout-tp", k
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"efficiency": {"hbm_eff": 1.5}}, "efficiency.hbm_eff = 1.5 is not physically plausible"),
        ({"efficiency": {"mfu_train": 0.0}}, "efficiency.mfu_train = 0 is not physically plausible"),
        ({"efficiency": {"decode_overhead_s": -0.001}}, "efficiency.decode_overhead_s = -0.001 s < 0"),
        ({"efficiency": {"mfu_infer": None}}, "missing 'efficiency.mfu_infer'"),
        ({"efficiency": {"mfu_infer": "fast"}}, "efficiency.mfu_infer must be a number"),
        ({"efficiency": {"tp_unsplit": -1.0}}, "efficiency.tp_unsplit = -1 is not physically plausible"),
        ({"efficiency": {"tp_unsplit": 5e3}}, "efficiency.tp_unsplit = 5000 is not physically plausible"),
        ({"gpu_type": None}, "missing 'gpu_type'"),
        ({"nominal": None}, "missing 'nominal'"),
        ({"gpu_type": "H100"}, "gpu_type 'H100' is not a GPU type of cluster cpu"),
    ],
)
def test_a_bad_profile_is_one_clear_error(tmp_path, change, needle):
    doc = profile_doc()
    for key, value in change.items():
        if isinstance(value, dict):
            for k, v in value.items():
                doc[key].pop(k) if v is None else doc[key].__setitem__(k, v)
        elif value is None:
            doc.pop(key)
        else:
            doc[key] = value
    path = write(tmp_path, doc)
    r = subprocess.run(
        [sys.executable, "schedule.py", "--cluster", "exp/clusters/cpu.yaml", "--model", "exp/tiny-model"]
        + ["--nproc", "4", "--quiet", "--profile", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def run_profile(cluster, gpu_type: str, seconds: float, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`schedule.py profile --nominal measured` as a user runs it; asserts it exited 0. It runs in a session of its
    own: on a timeout the whole session is killed, its spawned peers (co-load, TP/DP steps, link) with it, so that
    none is left running beside the rest of the suite."""
    cmd = [sys.executable, "schedule.py", "profile", "--cluster", str(cluster), "--gpu-type", gpu_type]
    cmd += ["--seconds", str(seconds), "--nominal", "measured", "--out", str(out), *extra]
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"schedule.py profile ran past 180 s:\n{stdout[-2000:]}{stderr[-2000:]}")
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.alone  # the profile's own wall time is held to 120 s, and the run to 180 s
def test_profile_cli_smoke_on_cpu(tmp_path):
    """`schedule.py profile --seconds 10` on CPU (about 15-30 s with imports and model builds): it runs the runtime's
    Generator and Trainer, writes a profile the planner reads back, and prints the constants."""
    out = tmp_path / "cpu.yaml"
    r = run_profile("exp/clusters/cpu.yaml", "cpu", 10, out)
    for what in ("gemm:", "copy:", "decode:", "prefill:", "train:", "mfu_train", "hbm_eff", "decode_overhead_s"):
        assert what in r.stdout, r.stdout
    doc = yaml.safe_load(out.read_text())
    prof = profile_fit.load_profile(out)
    assert prof.gpu_type == "cpu" and doc["device"] and doc["dtype"] == "float32"
    m = doc["measured"]  # the nominal: the fastest rates measured, GEMM / copy points or fits
    assert prof.tflops == max(m["gemm_tflops"], m["prefill_tflops"], m["train_tflops"], m.get("decode_tflops", 0))
    assert prof.hbm_tbps == max(m["copy_tbps"], m["decode_tbps"])
    assert doc["points"]["decode"] and doc["points"]["prefill"] and doc["points"]["train"]
    tp_steps = doc["points"]["train_tp"]  # real 2-process TP steps
    assert tp_steps["tp"] == 2 and len(tp_steps["points"]) == 2 and all(p["step_s"] > 0 for p in tp_steps["points"])
    assert prof.efficiency.tp_unsplit == doc["efficiency"]["tp_unsplit"] >= 0 and prof.efficiency.tp_overhead_s >= 0
    dp_steps = doc["points"]["train_dp"]  # real 2-process DP steps
    assert dp_steps["dp"] == 2 and len(dp_steps["points"]) == 2 and all(p["step_s"] > 0 for p in dp_steps["points"])
    assert prof.efficiency.dp_overhead_s == doc["efficiency"]["dp_overhead_s"] >= 0
    for p in tp_steps["points"] + dp_steps["points"]:  # two passes each, the faster kept
        assert len(p["pass_s"]) == 2 and p["step_s"] == min(p["pass_s"])
    assert doc["seconds"] < 120


@pytest.mark.alone  # decode_beside: a wall time over a CPU time, held to [0.5, 4]; the run to 180 s
def test_profiling_an_emulated_type_runs_its_throttle_and_applies_to_it_alone(tmp_path):
    """`schedule.py profile --gpu-type h800ish --co-load 2 --co-load-trainers 1` on the emulated cluster: the
    Generator's steps are padded by the type's throttle (it slept) beside a peer that trained and one that decoded
    meanwhile, the profile records the fractions and the co-load, and it prices that type only."""
    spec = yaml.safe_load((ROOT / "exp/clusters/cpu_hetero.yaml").read_text())
    spec["gpu_types"]["h800ish"]["emulate"] = {"compute": 0.8, "bandwidth": 0.7, "link": 0.5}  # mild: a short test
    cluster = write(tmp_path, spec, "hetero.yaml")
    out = tmp_path / "h800ish.yaml"
    r = run_profile(cluster, "h800ish", 8, out, "--co-load", "2", "--co-load-trainers", "1")
    assert "under its throttle" in r.stdout and "co-load: 2 peers (1 training, 1 decoding 8 rows)" in r.stdout
    doc = yaml.safe_load(out.read_text())
    assert doc["co_load"]["peers"] == 2 and doc["co_load"]["trainers"] == 1 and len(doc["co_load"]["peer_steps"]) == 2
    assert all(n > 0 for n in doc["co_load"]["peer_steps"])  # each trained or decoded while the points were measured
    assert doc["emulate"] == {"compute": 0.8, "bandwidth": 0.7, "link": 0.5}
    # its replica's decode step again beside each emulated type's trainers, its own first
    assert "co-load: 2 peers (1 training as h20ish, 1 decoding 8 rows) working" in r.stdout
    beside = doc["points"]["decode_beside"]
    assert list(beside["points"]) == ["h800ish", "h20ish"] and beside["fraction"] == 0.7
    for p in beside["points"].values():
        assert p["runs"] >= 3 and p["wall_s"] > p["cpu_s"] > 0  # padded: the wall is the CPU time / 0.7 and more
    gpu = specs.GPUType("h800ish", 2, doc["nominal"]["tflops"], doc["nominal"]["hbm_tbps"], 1.0, 2.0)
    te = specs.TypeEfficiency(**{k: v for k, v in doc["efficiency"].items() if k != "decode_beside"})
    assert doc["efficiency"]["decode_beside"] == pytest.approx(profile_fit.decode_beside_fit(beside, gpu, te))
    assert doc["throttle_slept_s"]["bandwidth"] > 0 and doc["throttle_slept_s"]["compute"] > 0
    assert "sync" not in doc  # the link is padded by its wall time, exactly: not measured under the throttle
    prof = profile_fit.load_profile(out)
    assert prof.emulated and prof.gpu_type == "h800ish"
    assert set(prof.efficiency.decode_beside) == {"h800ish", "h20ish"}
    hetero = specs.load_cluster(cluster)
    eff = profile_fit.apply_profile(specs.Efficiency(), hetero, prof, str(out))
    assert set(eff.per_type) == {"h800ish"}  # not the other emulated type, as a machine profile would
    with pytest.raises(specs.SpecError, match="applies to that type only"):
        profile_fit.apply_profile(
            specs.Efficiency(), specs.load_cluster(ROOT / "exp/clusters/cpu.yaml"), prof, str(out)
        )


def test_bad_host_cores_from_the_cli_is_one_line(tmp_path):
    doc = yaml.safe_load((ROOT / "exp/clusters/cpu.yaml").read_text())
    doc["machines"][0]["host_cores"] = 0
    path = write(tmp_path, doc, "cluster.yaml")
    r = subprocess.run(
        [sys.executable, "schedule.py", "--cluster", str(path), "--model", str(TINY), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "machines[0].host_cores must be a number > 0" in lines[0], r.stderr


@pytest.mark.parametrize("bad", [["--plan", "/nonexistent.json"], []])
def test_cli_refuses_missing_inputs(bad, tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "exp/estimate_memory.py"), "--config", "gpu_r1_7b", *bad],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "error" in out.stderr.lower()
