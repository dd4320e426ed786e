"""Device profiles (`schedule.py profile`): the least-squares fits, the YAML the planner reads, its checks, and that a
plan made with a profile uses its constants."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import schedule  # noqa: E402
from planner import cost_model, profile_fit, search, specs  # noqa: E402

CPU = specs.GPUType("cpu", 2, 0.02, 0.005, 0.05, 2.0)
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
    got_rate, got_overhead, r2 = profile_fit.fit_rate(work, exact, "decode")
    assert got_rate == pytest.approx(rate, rel=1e-9)
    assert got_overhead == pytest.approx(overhead, rel=1e-6)
    assert r2 == pytest.approx(1.0)
    noisy = [t * (1 + 0.01 * (-1) ** i) for i, t in enumerate(exact)]
    got_rate, got_overhead, r2 = profile_fit.fit_rate(work, noisy, "decode")
    assert got_rate == pytest.approx(rate, rel=0.03)
    assert got_overhead == pytest.approx(overhead, rel=0.15)
    assert r2 > 0.99
    with pytest.raises(specs.SpecError, match="decode: time does not grow with the work"):
        profile_fit.fit_rate([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], "decode")


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
    profile_fit.finish_profile(out, CPU, log=lambda *_: None)
    e = out["efficiency"]
    assert e["hbm_eff"] == pytest.approx(bw / 5e9)
    assert e["mfu_infer"] == pytest.approx(prefill / 2e10)
    assert e["mfu_train"] == pytest.approx(train / 2e10)
    assert e["decode_overhead_s"] == pytest.approx(overhead)
    assert out["measured"]["train_overhead_s"] == pytest.approx(0.2)
    assert all(p["memory_bound"] for p in decode)
    # against a type 10x slower than these rates the fractions are 4-6: refused, naming the first constant
    with pytest.raises(specs.SpecError, match=r"efficiency\.mfu_train = 4 is not physically plausible"):
        profile_fit.finish_profile(out, specs.GPUType("cpu", 2, 0.002, 0.005, 0.05, 2.0), log=lambda *_: None)


def test_a_measured_nominal_is_the_fastest_rate_the_profile_saw():
    """--nominal measured: a fit that outran the GEMM / copy points sets the nominal (mfu 1 at most, never refused as
    implausible), and the achieved rates -- fraction x nominal, what the planner prices -- stay the fitted ones."""
    prefill, train, bw = 12e9, 30e9, 3.5e9  # the train fit outruns the 15 GFLOP/s GEMM points
    out = {
        "device": "synthetic",
        "gemm_tflops": 0.015,
        "copy_tbps": 0.004,
        "decode": [{"bytes": b, "flops": 1e6, "step_s": b / bw + 0.001} for b in (1.2e7, 3e7, 9e7)],
        "prefill": [{"flops": f, "step_s": f / prefill + 0.004} for f in (4e8, 1.6e9, 3.3e9)],
        "train": [{"flops": f, "step_s": f / train + 0.2} for f in (7e9, 2e10, 4e10)],
    }
    with pytest.raises(specs.SpecError, match=r"efficiency\.mfu_train = 2 is not physically plausible"):
        profile_fit.finish_profile(dict(out), specs.GPUType("cpu", 2, 0.015, 0.004, 0.05, 2.0), log=lambda *_: None)
    said = []
    profile_fit.finish_profile(
        out, specs.GPUType("cpu", 2, 0.015, 0.004, 0.05, 2.0), said.append, measured_nominal=True
    )
    assert out["nominal"]["tflops"] == pytest.approx(train / 1e12) and out["nominal"]["hbm_tbps"] == 0.004
    e = out["efficiency"]
    assert e["mfu_train"] == pytest.approx(1.0) and e["mfu_infer"] == pytest.approx(prefill / train)
    assert e["hbm_eff"] * out["nominal"]["hbm_tbps"] * 1e12 == pytest.approx(bw)
    assert "nominal: the fastest rates measured: FLOP/s from the train fit, bandwidth from the copy points" in said


TINY = specs.load_model_spec(ROOT / "exp/tiny-model")


def tp_workload(prompts: int) -> specs.Workload:
    """A step of `prompts` x 8 sequences of 32 + 32 tokens in 2 minibatches of 512-token micro-batches, 4 passes."""
    return specs.Workload(prompts_per_step=prompts, samples_per_prompt=8, prompt_len=32, gen_samples=[32.0],
                       precision="fp32", ppo_minibatches=2, microbatch_tokens=512, train_passes=4.0)  # fmt: skip


def step_flops(wl: specs.Workload) -> float:
    return (
        wl.train_passes
        * wl.tokens_per_step
        * (TINY.layers * TINY.layer_flops_per_token(wl.decode_context) + 2 * TINY.head_params)
    )


def tp_profile_points(tp_fractions: list[float]) -> dict:
    """Synthetic profile points of the tiny model whose TP-2 steps, one per workload tp_workload(2), (8), ..., take
    these fractions of the tp-1 line's step of the same FLOPs."""
    rate, intercept, bw = 8e9, 0.2, 3.5e9
    train = [{"flops": f, "step_s": f / rate + intercept, "optimizer_params": TINY.optimizer_params,
              "optimizer_steps": 2}
             for f in (1e9, 5e9, 2e10)]  # fmt: skip
    points = []
    for k, frac in enumerate(tp_fractions):
        wl = tp_workload(2 * 4**k)
        flops = step_flops(wl)
        points.append({"trajectories": wl.batch, "tokens": int(wl.tokens_per_step), "flops": flops,
                       "step_s": frac * (flops / rate + intercept)})  # fmt: skip
    return {
        "device": "synthetic",
        "gemm_tflops": 0.015,
        "copy_tbps": 0.004,
        "decode": [{"bytes": b, "flops": 1e6, "step_s": b / bw + 0.001} for b in (1.2e7, 3e7, 9e7)],
        "prefill": [{"flops": f, "step_s": f / 12e9 + 0.004} for f in (4e8, 1.6e9, 3.3e9)],
        "train": train,
        "train_tp": {
            "tp": 2,
            "layers": TINY.layers,
            "hidden": TINY.hidden,
            "passes": 4.0,
            "bytes": 4,
            "micro_batch_tokens": 512,
            "optimizer_steps": 2,
            "intra_gbps": CPU.intra_gbps,
            "points": points,
        },  # fmt: skip
    }


def test_tp_steps_give_tp_unsplit_and_tp_overhead_and_the_cost_model_gives_the_steps_back():
    """finish_profile's tp_unsplit and tp_overhead_s are what make train_step_seconds at tp 2 equal the measured TP
    steps, on the workloads those steps were; at tp 1 neither term acts; TP steps no slower than the model without
    them give 0; a profile without TP steps has neither."""
    stage = cost_model.StageSpec("cpu", TINY.layers, (0,), CPU.intra_gbps, 2.0, 0.0)

    def priced(out: dict, wl: specs.Workload, tp: int) -> float:
        prof = profile_fit.profile_from_dict({**out, "gpu_type": "cpu"}, "synthetic")
        eff = profile_fit.apply_profile(
            specs.Efficiency(), specs.load_cluster(ROOT / "exp/clusters/cpu.yaml"), prof, "synthetic"
        )
        return cost_model.train_step_seconds(TINY, [stage], 1, tp, {"cpu": CPU}, wl, eff)

    out = tp_profile_points([0.8, 0.7])  # a TP rank at 80% / 70% of one rank's step: much left whole
    profile_fit.finish_profile(out, CPU, log=lambda *_: None)
    e = out["efficiency"]
    assert e["tp_unsplit"] > 0 and e["tp_overhead_s"] > 0 and out["measured"]["train_tp_unsplit"] == e["tp_unsplit"]
    for k, p in enumerate(out["train_tp"]["points"]):
        wl = tp_workload(2 * 4**k)
        assert priced(out, wl, 2) == pytest.approx(p["step_s"], rel=1e-9)
        assert priced(out, wl, 1) == pytest.approx(p["step_s"] / (0.8, 0.7)[k], rel=1e-9)  # the tp-1 line
    fast = tp_profile_points([0.3, 0.3])  # below half a step: nothing left whole to charge
    profile_fit.finish_profile(fast, CPU, log=lambda *_: None)
    assert fast["efficiency"]["tp_unsplit"] == 0.0 and fast["efficiency"]["tp_overhead_s"] == 0.0
    one = tp_profile_points([0.8])  # one TP step: all of it per token
    profile_fit.finish_profile(one, CPU, log=lambda *_: None)
    assert one["efficiency"]["tp_overhead_s"] == 0.0
    assert priced(one, tp_workload(2), 2) == pytest.approx(one["train_tp"]["points"][0]["step_s"], rel=1e-9)
    without = tp_profile_points([])
    del without["train_tp"]
    profile_fit.finish_profile(without, CPU, log=lambda *_: None)
    assert "tp_unsplit" not in without["efficiency"] and "tp_overhead_s" not in without["efficiency"]


def test_dp_steps_give_dp_overhead_and_the_cost_model_gives_the_steps_back():
    """finish_profile's dp_overhead_s is what makes train_step_seconds at dp 2 give back the measured DP steps (on
    average over them, on the workloads they were: one sequence per trajectory, 2 minibatches, the profile's
    micro-batches); at dp 1 it does not act; DP steps no slower than the model give 0; without DP steps it is
    absent."""
    stage = cost_model.StageSpec("cpu", TINY.layers, (0,), CPU.intra_gbps, CPU.intra_gbps, 0.0)

    def workload(n: int) -> specs.Workload:
        return specs.Workload(prompts_per_step=n, samples_per_prompt=1, prompt_len=32, gen_samples=[32.0],
                           precision="fp32", ppo_minibatches=2, microbatch_tokens=512, train_passes=4.0)  # fmt: skip

    def priced(out: dict, n: int, dp: int) -> float:
        prof = profile_fit.profile_from_dict({**out, "gpu_type": "cpu"}, "synthetic")
        eff = profile_fit.apply_profile(
            specs.Efficiency(), specs.load_cluster(ROOT / "exp/clusters/cpu.yaml"), prof, "synthetic"
        )
        return cost_model.train_step_seconds(TINY, [stage], dp, 1, {"cpu": CPU}, workload(n), eff)

    def with_dp_steps(extra_s: list[float]) -> dict:
        out = tp_profile_points([])
        del out["train_tp"]
        profile_fit.finish_profile(out, CPU, log=lambda *_: None)
        points = [{"trajectories": n, "prompt": 32, "response": 32, "tokens": 64 * n, "flops": 0.0,
                   "step_s": priced(out, n, 2) + e} for n, e in zip((16, 64), extra_s)]  # fmt: skip
        out["train_dp"] = {"dp": 2, "tp": 1, "passes": 4.0, "micro_batch_tokens": 512, "optimizer_steps": 2,
                           "intra_gbps": CPU.intra_gbps, "model_config": TINY.to_config(), "points": points}  # fmt: skip
        profile_fit.finish_profile(out, CPU, log=lambda *_: None)
        return out

    out = with_dp_steps([0.03, 0.05])  # each DP step 30 / 50 ms above what the model charges without the term
    assert out["efficiency"]["dp_overhead_s"] == pytest.approx(0.04 / 2, rel=1e-6)  # per optimizer step
    assert out["measured"]["train_dp_overhead_s"] == out["efficiency"]["dp_overhead_s"]
    steps = [p["step_s"] for p in out["train_dp"]["points"]]
    assert (priced(out, 16, 2) + priced(out, 64, 2)) / 2 == pytest.approx(sum(steps) / 2, rel=1e-9)
    assert priced(out, 16, 1) == pytest.approx(priced(with_dp_steps([0.0, 0.0]), 16, 1), rel=1e-12)  # dp 1: no term
    assert with_dp_steps([-0.01, -0.02])["efficiency"]["dp_overhead_s"] == 0.0  # faster than the model: nothing
    without = tp_profile_points([])
    del without["train_tp"]
    profile_fit.finish_profile(without, CPU, log=lambda *_: None)
    assert "dp_overhead_s" not in without["efficiency"]


def test_profile_yaml_round_trip(tmp_path):
    doc = profile_doc()
    prof = profile_fit.load_profile(write(tmp_path, doc))
    assert prof == profile_fit.DeviceProfile("cpu", specs.TypeEfficiency(0.4, 0.6, 0.7, 0.002), 0.02, 0.005)
    cluster = specs.load_cluster("exp/clusters/cpu.yaml")
    eff = profile_fit.apply_profile(specs.Efficiency(), cluster, prof, "p.yaml")
    assert eff.of("cpu") == prof.efficiency  # same nominal numbers: taken as they are
    # other nominal numbers than the cluster's: rescaled so that the achieved rates stay the measured ones
    other = profile_fit.DeviceProfile("cpu", prof.efficiency, 0.1, 0.01)
    te = profile_fit.apply_profile(specs.Efficiency(), cluster, other, "p.yaml").of("cpu")
    assert te.mfu_infer * 0.02 == pytest.approx(0.6 * 0.1)
    assert te.mfu_train * 0.02 == pytest.approx(0.4 * 0.1)
    assert te.hbm_eff * 0.005 == pytest.approx(0.7 * 0.01)
    assert te.decode_overhead_s == 0.002


def tiny_plan(tmp_path: Path, overhead: float | None) -> dict:
    args = ["--cluster", "exp/clusters/cpu.yaml", "--model", str(ROOT / "exp" / "tiny-model"), "--nproc", "4"]
    args += ["--prompts", "16", "--samples", "8", "--prompt-len", "20", "--gen-mean", "24", "--max-batch", "64"]
    args += ["--quiet", "--out", str(tmp_path / f"plan_{overhead}.json"), "--train-layout", "2,1,1"]
    if overhead is not None:
        args += ["--profile", str(write(tmp_path, profile_doc(decode_overhead_s=overhead), f"p_{overhead}.yaml"))]
    assert schedule.main(args) == 0
    return json.loads((tmp_path / f"plan_{overhead}.json").read_text())


def test_planning_with_a_profile_uses_it(tmp_path):
    """The profile's constants reach the plan: every replica's decode round is the bytes / (HBM x hbm_eff) roofline
    plus the profile's overhead, so a larger overhead gives a longer predicted rollout, by the formula."""
    plain = tiny_plan(tmp_path, None)
    base, slow = tiny_plan(tmp_path, 0.0), tiny_plan(tmp_path, 0.01)
    assert base["inputs"]["efficiency"]["per_type"]["cpu"]["hbm_eff"] == 0.7
    assert "cpu" not in plain["inputs"]["efficiency"]["per_type"]
    for pj, overhead in ((base, 0.0), (slow, 0.01)):
        p, _ = schedule.planner_from_plan(pj)
        te = p.eff.of("cpu")
        assert te.decode_overhead_s == overhead
        wl, model, gpu = p.wl, p.model, p.cluster.gpu("cpu")
        # cpu.yaml's 4 processes share 2 cores (host_cores) by how many are busy at once in the step priced
        busy = {int(m): b for m, b in pj["predicted"]["busy_devices"].items()}
        speed = p.cluster.speeds.with_busy_devices(busy).decode_speed("cpu")  # a replica's, in the rollout role
        assert 0.5 <= speed < 1.0
        tokens_per_s = 0.0
        for rep in pj["rollout"]["replicas"]:
            roofline = cost_model.decode_round_s(
                model, gpu, specs.TypeEfficiency(te.mfu_train, te.mfu_infer, te.hbm_eff), rep["tp"], 1, rep["batch"],
                wl.decode_context, wl.bytes, 1.0, speed,
            )  # fmt: skip
            assert rep["round_s"] == pytest.approx(roofline + overhead / speed, rel=1e-12)
            tokens_per_s += rep["batch"] / rep["round_s"]
        # prefill: each group's prompt once, and the running sequences' K/V recomputed as far as the rollout
        # overruns the train step (cost_model.rollout_seconds), on the replicas' compute
        per_token = 2 * model.params / (sum(r["tp"] for r in pj["rollout"]["replicas"]) * gpu.tflops * 1e12)
        per_token /= te.mfu_infer * speed
        base_s = wl.batch * wl.gen_mean / tokens_per_s + cost_model.prompt_prefill_tokens(wl) * per_token
        full = cost_model.recompute_tokens(wl, sum(r["batch"] for r in pj["rollout"]["replicas"])) * per_token
        overrun = min(1.0, max(0.0, (base_s + full - pj["predicted"]["train_s"]) / full))
        assert pj["predicted"]["rollout_s"] == pytest.approx(base_s + full * overrun)
    assert slow["predicted"]["rollout_s"] > base["predicted"]["rollout_s"]


def test_the_parallel_steps_keep_each_points_faster_pass():
    from planner import device_profile

    first = {"dp": 2, "tp": 1, "points": [{"tokens": 10, "step_s": 1.0}, {"tokens": 40, "step_s": 3.0}]}
    second = {"dp": 2, "tp": 1, "points": [{"tokens": 10, "step_s": 1.4}, {"tokens": 40, "step_s": 2.5}]}
    out = device_profile._faster_pass([first, second])
    assert out["dp"] == 2 and [p["tokens"] for p in out["points"]] == [10, 40]
    assert [p["step_s"] for p in out["points"]] == [1.0, 2.5]
    assert [p["pass_s"] for p in out["points"]] == [[1.0, 1.4], [3.0, 2.5]]
    assert first["points"][1]["step_s"] == 3.0  # the passes themselves are kept as measured
    assert (
        device_profile._faster_pass([first, {}]) == {} and device_profile._faster_pass([]) == {}
    )  # a pass that measured nothing


def test_profile_rejects_a_negative_co_load_and_more_trainers_than_peers():
    assert schedule.main(["profile", "--co-load", "-1"]) != 0
    assert schedule.main(["profile", "--co-load", "1", "--co-load-trainers", "2"]) != 0


# ----------------------------------------------------------------------------- the paper's H800 / H20 profiles

sys.path.insert(0, str(ROOT / "exp"))
import reproduce_paper as rp  # noqa: E402

PAPER_PROFILES = rp.PROFILE_SETS["table1"]  # exp/reproduce_paper.py's default: the paper's Table 1 as the profile
ASSUMED_PROFILES = rp.PROFILE_SETS["assumed"]  # physics-only fractions, the same for both types


def test_paper_profiles_load_pass_the_checks():
    """Both sets load as `--profile` reads them (the plausibility checks run there) and carry the paper's stated
    peaks; the assumed set shares its fractions between the types; the Table-1 set has the assumed set's nominal,
    hardware and links, its own fractions per type, and the assumed set's (unfitted) decode overhead."""
    for paths in (PAPER_PROFILES, ASSUMED_PROFILES):
        profs = {t: profile_fit.load_profile(p) for t, p in paths.items()}
        assert {t: (p.gpu_type, p.tflops, p.hbm_tbps) for t, p in profs.items()} == {
            "H800": ("H800", 756.0, 2.0),
            "H20": ("H20", 148.0, 4.0),
        }
        for p in profs.values():
            for key in profile_fit.PROFILE_FRACTIONS:
                assert 0 < getattr(p.efficiency, key) <= 1  # not merely <= the check's 1.2 slack
        cluster = specs.load_cluster(ROOT / "exp/clusters/hetero_32.yaml")
        eff = specs.Efficiency()
        for t, p in paths.items():
            eff = profile_fit.apply_profile(eff, cluster, profs[t], str(p))
            assert eff.of(t) == profs[t].efficiency  # the shipped cluster has the same nominal numbers
    assumed = {t: profile_fit.load_profile(p) for t, p in ASSUMED_PROFILES.items()}
    assert assumed["H800"].efficiency == assumed["H20"].efficiency
    table1 = {t: profile_fit.load_profile(p) for t, p in PAPER_PROFILES.items()}
    assert table1["H800"].efficiency != table1["H20"].efficiency
    for t in ("H800", "H20"):
        a, b = (yaml.safe_load(paths[t].read_text()) for paths in (ASSUMED_PROFILES, PAPER_PROFILES))
        assert {k: b[k] for k in ("nominal", "hardware", "links")} == {
            k: a[k] for k in ("nominal", "hardware", "links")
        }
        assert table1[t].efficiency.decode_overhead_s == assumed[t].efficiency.decode_overhead_s


def test_table1_derivation_reproduces_table1_per_gpu(tmp_path, monkeypatch):
    """derive_table1 turns Table 1 ($ per 1K tokens) and the $/h prices into tokens/s per GPU and fits one set of
    fractions per type. Recomputed here: cost_model's per-GPU tokens/s with the fit are within 50% of Table 1's for
    every model (the largest residual is 45%, training: Table 1's 7B trains at 1.84x the 1.5B's cost per token,
    its FLOPs are 4x); the H20/H800 ratio per GPU, which the planner's split depends on, within 10%. The fit reads
    no result of the paper and none of the base profiles' fractions; the shipped Table-1 profiles are its output."""
    assert rp.table1_rates("1.5B", "H800", 5.28) == pytest.approx((5.28 / 3600 / 5.58e-6, 5.28 / 3600 / 1.66e-6))
    for name in ("FIG3", "FIG4_H800", "FIG4_H20", "FIG4_HEX", "SYNC", "TABLE4", "TABLE4_COST"):
        monkeypatch.setattr(rp, name, None)  # a result used by the derivation would fail on None
    # the base profiles' fractions are not read (their decode overhead is: it is kept, not fitted)
    base = rp.paper_devices(
        copy_profiles(
            tmp_path / "other_fractions",
            H800={"efficiency": {"mfu_train": 0.9, "mfu_infer": 0.2, "hbm_eff": 0.3}},
            H20={"efficiency": {"mfu_train": 0.1, "mfu_infer": 0.9, "hbm_eff": 0.9}},
            paths=ASSUMED_PROFILES,
        )
    )
    fits = rp.derive_table1(base)
    shipped = rp.paper_devices(PAPER_PROFILES)
    for t, fit in fits.items():
        price = base[t].gpu.dollars_per_hour
        for size in rp.MODELS:
            model = specs.load_model_spec(rp.MODELS[size])
            cost = rp.TABLE1[size]
            i = ("H800", "H20").index(t)
            table1 = (price / 3600 / (cost[0][i] / 1000), price / 3600 / (cost[1][i] / 1000))
            ours = (
                rp.rollout_per_gpu(model, base[t], fit.efficiency)[0],
                rp.train_per_gpu(model, base[t], fit.efficiency)[0],
            )
            assert fit.table1[size] == pytest.approx(table1) and fit.ours[size] == pytest.approx(ours)
            for phase in (0, 1):
                assert abs(ours[phase] / table1[phase] - 1) < 0.5, (t, size, phase, ours, table1)
        got, want = shipped[t].profile.efficiency, fit.efficiency
        for key in (*profile_fit.PROFILE_FRACTIONS, "decode_overhead_s"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-3), (t, key)  # 4 digits in the YAML
    for size in rp.MODELS:
        for phase in (0, 1):
            ours = fits["H20"].ours[size][phase] / fits["H800"].ours[size][phase]
            paper = fits["H20"].table1[size][phase] / fits["H800"].table1[size][phase]
            assert ours == pytest.approx(paper, rel=0.1), (size, phase)


def copy_profiles(where: Path, paths: dict[str, Path] | None = None, **changes) -> dict[str, Path]:
    """The paper profiles (default set) copied into the new folder `where`, with changes {gpu type: {section: {key:
    value}}}."""
    where.mkdir()
    out = {}
    for t, src in (paths or PAPER_PROFILES).items():
        doc = yaml.safe_load(src.read_text())
        for section, values in changes.get(t, {}).items():
            doc[section].update(values)
        out[t] = write(where, doc, f"{t}.yaml")
    return out


@pytest.mark.parametrize("profile_set", ["table1", "assumed"])
def test_reproduce_paper_takes_its_device_constants_only_from_the_profiles(tmp_path, monkeypatch, profile_set):
    """The clusters and efficiencies exp/reproduce_paper.py plans with are the profiles' numbers, whatever the shipped
    cluster YAMLs say; a profile value changed moves the prediction the way the cost model says it should."""
    paths = rp.PROFILE_SETS[profile_set]
    devices = rp.paper_devices(copy_profiles(tmp_path / "as_shipped", paths))
    c = rp.paper_cluster("hetero_32", devices)
    assert c.gpu("H800") == specs.GPUType("H800", 80.0, 756.0, 2.0, 5.28, 200.0)
    assert c.gpu("H20") == specs.GPUType("H20", 96.0, 148.0, 4.0, 1.85, 450.0)
    assert c.inter_gbps == {("H800", "H800"): 5.0, ("H20", "H20"): 5.0, ("H20", "H800"): 1.5}
    assert rp.paper_efficiency(c, devices).of("H20") == devices["H20"].profile.efficiency

    # a fixed split (the H800 machine trains, the three H20 machines roll out) priced with profile values changed
    def predict(tag: str, **changes) -> search.Evaluation:
        devs = rp.paper_devices(copy_profiles(tmp_path / tag, paths, **changes))
        cl = rp.paper_cluster("hetero_32", devs)
        model = specs.load_model_spec("deepseek-r1-distill-qwen-1.5b")
        return search.Planner(cl, model, rp.workload(), rp.paper_efficiency(cl, devs)).evaluate((8, 0, 0, 0))

    half = {
        t: {k: getattr(d.profile.efficiency, k) / 2 for k in profile_fit.PROFILE_FRACTIONS} for t, d in devices.items()
    }
    base = predict("base")
    slow_h20_hbm = predict("h20_hbm", H20={"efficiency": {"hbm_eff": half["H20"]["hbm_eff"]}})
    slow_h800_train = predict("h800_mfu", H800={"efficiency": {"mfu_train": half["H800"]["mfu_train"]}})
    slow_link = predict(
        "cross_link",
        H800={"links": {"inter_gbps": {"H800": 5.0, "H20": 0.75}}},
        H20={"links": {"inter_gbps": {"H20": 5.0, "H800": 0.75}}},
    )
    assert base.tokens_per_s > 0
    assert slow_h20_hbm.rollout_s > base.rollout_s and slow_h20_hbm.train_s == base.train_s
    # the trainer's constant leaves the replicas' rates alone; only the KV recompute the rollout side still has to
    # do when the slower trainer's update comes can change (cost_model.rollout_seconds), and never up
    assert slow_h800_train.train_s > 1.5 * base.train_s and slow_h800_train.rollout_s <= base.rollout_s
    assert (slow_h800_train.rollout.tokens_per_s, slow_h800_train.rollout.prefill_tflops) == (
        base.rollout.tokens_per_s,
        base.rollout.prefill_tflops,
    )
    assert slow_link.sync_s > base.sync_s and slow_link.rollout_s == base.rollout_s

    # the shipped cluster YAML's GPU numbers and links are not read, only its machines: nonsense there changes nothing
    fake_root = tmp_path / "root"
    (fake_root / "exp/clusters").mkdir(parents=True)
    doc = yaml.safe_load((ROOT / "exp/clusters/hetero_32.yaml").read_text())
    doc["gpu_types"]["H20"].update(tflops=1.0, hbm_tbps=0.1, hbm_gb=8, dollars_per_hour=99.0)
    doc["links"]["inter_gbps"]["H800-H20"] = 0.01
    (fake_root / "exp/clusters/hetero_32.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setattr(rp, "ROOT", fake_root)
    assert rp.paper_cluster("hetero_32", devices) == c
    assert predict("fake_root").step_s == base.step_s


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"efficiency": {"hbm_eff": 1.5}}, "efficiency.hbm_eff = 1.5 is not physically plausible"),
        ({"hardware": {"hbm_gb": "big"}}, "a paper profile needs hardware."),
        ({"links": {"inter_gbps": {"H20": 5.0, "H800": 2.0}}}, "profiles disagree on the H20-H800 link"),
    ],
)
@pytest.mark.parametrize("profile_set", ["table1", "assumed"])
def test_a_bad_paper_profile_is_one_clear_error(tmp_path, change, needle, profile_set):
    with pytest.raises(specs.SpecError, match=needle):
        devices = rp.paper_devices(copy_profiles(tmp_path / "bad", rp.PROFILE_SETS[profile_set], H20=change))
        rp.paper_cluster("hetero_32", devices)
