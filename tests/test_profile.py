"""Device profiles (`schedule.py profile`): the least-squares fits, the YAML the planner reads, its checks, and that a
plan made with a profile uses its constants."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cost_model as cm  # noqa: E402
import schedule as sc  # noqa: E402

CPU = cm.GPUType("cpu", 2, 0.02, 0.005, 0.05, 2.0)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def profile_doc(**efficiency) -> dict:
    eff = {"mfu_train": 0.4, "mfu_infer": 0.6, "hbm_eff": 0.7, "decode_overhead_s": 0.002, **efficiency}
    return {
        "device": "test device",
        "gpu_type": "cpu",
        "efficiency": eff,
        "nominal": {"gpu_type": "cpu", "tflops": 0.02, "hbm_tbps": 0.005},
    }


def write(tmp_path: Path, doc: dict, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_fit_recovers_known_constants_from_synthetic_timings():
    """Least squares on made-up points: step = work / rate + overhead, exactly and with +-1% noise."""
    rate, overhead = 5e9, 0.002
    work = [1e7, 2e7, 3.5e7, 5e7, 8e7, 1.2e8]
    exact = [w / rate + overhead for w in work]
    got_rate, got_overhead, r2 = cm.fit_rate(work, exact, "decode")
    assert got_rate == pytest.approx(rate, rel=1e-9)
    assert got_overhead == pytest.approx(overhead, rel=1e-6)
    assert r2 == pytest.approx(1.0)
    noisy = [t * (1 + 0.01 * (-1) ** i) for i, t in enumerate(exact)]
    got_rate, got_overhead, r2 = cm.fit_rate(work, noisy, "decode")
    assert got_rate == pytest.approx(rate, rel=0.03)
    assert got_overhead == pytest.approx(overhead, rel=0.15)
    assert r2 > 0.99
    with pytest.raises(cm.SpecError, match="decode: time does not grow with the work"):
        cm.fit_rate([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], "decode")


def test_finish_profile_turns_synthetic_points_into_the_type_efficiency():
    """The whole fit of `schedule.py profile` on made-up points: the efficiencies are the known rates over the
    type's nominal numbers and the overhead is the known intercept."""
    bw, overhead, prefill, train = 3.5e9, 0.0015, 12e9, 8e9  # bytes/s, s, FLOP/s, FLOP/s
    decode = [{"bytes": b, "flops": 1e6, "step_s": b / bw + overhead} for b in (1.2e7, 1.25e7, 3e7, 3.1e7, 9e7, 9.3e7)]
    out = {
        "device": "synthetic",
        "gemm_tflops": 0.015,
        "copy_tbps": 0.004,
        "decode": decode,
        "prefill": [{"flops": f, "step_s": f / prefill + 0.004} for f in (4e8, 1.6e9, 3.3e9)],
        "train": [{"flops": f, "step_s": f / train + 0.2} for f in (7e9, 2e10, 4e10)],
    }
    cm.finish_profile(out, CPU, log=lambda *_: None)
    e = out["efficiency"]
    assert e["hbm_eff"] == pytest.approx(bw / 5e9)
    assert e["mfu_infer"] == pytest.approx(prefill / 2e10)
    assert e["mfu_train"] == pytest.approx(train / 2e10)
    assert e["decode_overhead_s"] == pytest.approx(overhead)
    assert out["measured"]["train_overhead_s"] == pytest.approx(0.2)
    assert all(p["memory_bound"] for p in decode)
    # against a type 10x slower than these rates the fractions are 4-6: refused, naming the first constant
    with pytest.raises(cm.SpecError, match=r"efficiency\.mfu_train = 4 is not physically plausible"):
        cm.finish_profile(out, cm.GPUType("cpu", 2, 0.002, 0.005, 0.05, 2.0), log=lambda *_: None)


def test_profile_yaml_round_trip(tmp_path):
    doc = profile_doc()
    prof = cm.load_profile(write(tmp_path, doc))
    assert prof == cm.DeviceProfile("cpu", cm.TypeEfficiency(0.4, 0.6, 0.7, 0.002), 0.02, 0.005)
    cluster = cm.load_cluster("exp/clusters/cpu.yaml")
    eff = cm.apply_profile(cm.Efficiency(), cluster, prof, "p.yaml")
    assert eff.of("cpu") == prof.efficiency  # same nominal numbers: taken as they are
    # other nominal numbers than the cluster's: rescaled so that the achieved rates stay the measured ones
    other = cm.DeviceProfile("cpu", prof.efficiency, 0.1, 0.01)
    te = cm.apply_profile(cm.Efficiency(), cluster, other, "p.yaml").of("cpu")
    assert te.mfu_infer * 0.02 == pytest.approx(0.6 * 0.1)
    assert te.mfu_train * 0.02 == pytest.approx(0.4 * 0.1)
    assert te.hbm_eff * 0.005 == pytest.approx(0.7 * 0.01)
    assert te.decode_overhead_s == 0.002


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"efficiency": {"hbm_eff": 1.5}}, "efficiency.hbm_eff = 1.5 is not physically plausible"),
        ({"efficiency": {"mfu_train": 0.0}}, "efficiency.mfu_train = 0 is not physically plausible"),
        ({"efficiency": {"decode_overhead_s": -0.001}}, "efficiency.decode_overhead_s = -0.001 s < 0"),
        ({"efficiency": {"mfu_infer": None}}, "missing 'efficiency.mfu_infer'"),
        ({"efficiency": {"mfu_infer": "fast"}}, "efficiency.mfu_infer must be a number"),
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


def tiny_plan(tmp_path: Path, overhead: float | None) -> dict:
    args = ["--cluster", "exp/clusters/cpu.yaml", "--model", str(ROOT / "exp" / "tiny-model"), "--nproc", "4"]
    args += ["--prompts", "16", "--samples", "8", "--prompt-len", "20", "--gen-mean", "24", "--max-batch", "64"]
    args += ["--quiet", "--out", str(tmp_path / f"plan_{overhead}.json"), "--train-layout", "2,1,1"]
    if overhead is not None:
        args += ["--profile", str(write(tmp_path, profile_doc(decode_overhead_s=overhead), f"p_{overhead}.yaml"))]
    assert sc.main(args) == 0
    return json.loads((tmp_path / f"plan_{overhead}.json").read_text())


def test_planning_with_a_profile_uses_it(tmp_path):
    """The profile's constants reach the plan: every replica's decode round is the bytes / (HBM x hbm_eff) roofline
    plus the profile's overhead, so a larger overhead gives a longer predicted rollout, by the formula."""
    plain = tiny_plan(tmp_path, None)
    base, slow = tiny_plan(tmp_path, 0.0), tiny_plan(tmp_path, 0.01)
    assert base["inputs"]["efficiency"]["per_type"]["cpu"]["hbm_eff"] == 0.7
    assert "cpu" not in plain["inputs"]["efficiency"]["per_type"]
    for pj, overhead in ((base, 0.0), (slow, 0.01)):
        p, _ = sc.planner_from_plan(pj)
        te = p.eff.of("cpu")
        assert te.decode_overhead_s == overhead
        wl, model, gpu = p.wl, p.model, p.cluster.gpu("cpu")
        tokens_per_s = 0.0
        for rep in pj["rollout"]["replicas"]:
            roofline = cm.decode_round_s(
                model, gpu, cm.TypeEfficiency(te.mfu_train, te.mfu_infer, te.hbm_eff), rep["tp"], 1, rep["batch"],
                wl.decode_context, wl.bytes, 1.0,
            )  # fmt: skip
            assert rep["round_s"] == pytest.approx(roofline + overhead, rel=1e-12)
            tokens_per_s += rep["batch"] / rep["round_s"]
        prefill = (
            wl.batch
            * wl.prompt_len
            * 2
            * model.params
            / (sum(r["tp"] for r in pj["rollout"]["replicas"]) * gpu.tflops * 1e12)
        )
        prefill /= te.mfu_infer
        assert pj["predicted"]["rollout_s"] == pytest.approx(wl.batch * wl.gen_mean / tokens_per_s + prefill)
    assert slow["predicted"]["rollout_s"] > base["predicted"]["rollout_s"]


def test_profile_cli_smoke_on_cpu(tmp_path):
    """`schedule.py profile --seconds 10` on CPU (about 15-30 s with imports and model builds): it runs the runtime's
    Generator and Trainer, writes a profile the planner reads back, and prints the constants."""
    out = tmp_path / "cpu.yaml"
    r = subprocess.run(
        [sys.executable, "schedule.py", "profile", "--cluster", "exp/clusters/cpu.yaml", "--gpu-type", "cpu"]
        + ["--seconds", "10", "--nominal", "measured", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for what in ("gemm:", "copy:", "decode:", "prefill:", "train:", "mfu_train", "hbm_eff", "decode_overhead_s"):
        assert what in r.stdout, r.stdout
    doc = yaml.safe_load(out.read_text())
    prof = cm.load_profile(out)
    assert prof.gpu_type == "cpu" and doc["device"] and doc["dtype"] == "float32"
    assert prof.tflops == doc["measured"]["gemm_tflops"] and prof.hbm_tbps == doc["measured"]["copy_tbps"]
    assert doc["points"]["decode"] and doc["points"]["prefill"] and doc["points"]["train"]
    assert doc["seconds"] < 120
