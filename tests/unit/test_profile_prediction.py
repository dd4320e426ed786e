"""The cost-model terms behind acceptance 4 of issue 21 (a CPU profile predicts the CPU demo's step): CPU devices
sharing cores (`host_cores`), the per-optimizer-step train overhead, the decode compute rate, the profiled
weight-sync link, each against its formula; the profile keys round-trip and reach a plan; bad values are one clear
error; exp/check_profile_prediction.py compares a run with the prediction."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "exp"))

from test_profile import CPU, profile_doc, write  # noqa: E402

import schedule  # noqa: E402
from cpu_bench import host  # noqa: E402
from parallel import sync_layout  # noqa: E402
from planner import cost_model, profile_fit, search, specs  # noqa: E402

TINY = ROOT / "exp" / "tiny-model"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# the CPU demo's workload (exp/configs/cpu_demo.yaml; prompt and response lengths of its arithmetic task)
DEMO = dict(
    prompts_per_step=16,
    samples_per_prompt=8,
    prompt_len=29.0,
    gen_samples=[25.5],
    eta=4,
    precision="fp32",
    ppo_minibatches=1,
    microbatch_tokens=1024,
    max_batch=64,
    train_passes=3.0,
)


def cpu_cluster(host_cores=2, gpus: int = 4) -> specs.Cluster:
    """One machine of `gpus` CPU processes (exp/clusters/cpu.yaml's numbers) sharing `host_cores` cores."""
    machine = {"gpu_type": "cpu", "gpus": gpus, **({} if host_cores is None else {"host_cores": host_cores})}
    cpu = {"hbm_gb": 2, "tflops": 0.02, "hbm_tbps": 0.005, "dollars_per_hour": 0.05, "intra_gbps": 2.0}
    return specs.cluster_from_dict({"name": "cpu", "gpu_types": {"cpu": cpu}, "machines": [machine]}, "test.yaml")


# ----------------------------------------------------------------------------- host_cores


def test_host_cores_speed_is_cores_over_devices_capped_at_one():
    assert cpu_cluster(2, 4).speeds.speed(0) == 0.5
    assert cpu_cluster(2, 3).speeds.speed(0) == pytest.approx(2 / 3)
    assert cpu_cluster(2, 2).speeds.speed(0) == 1.0 and cpu_cluster(8, 4).speeds.speed(0) == 1.0
    assert cpu_cluster(None, 4).speeds.speed(0) == 1.0  # absent: devices do not share compute (GPUs)
    assert cpu_cluster(2, 4).speeds.type_speed("cpu") == 0.5
    # the shipped CPU cluster: this machine's 2 cores; --nproc resizes the devices, not the cores
    assert specs.load_cluster(ROOT / "exp/clusters/cpu.yaml").speeds.host_cores[0] == 2
    assert specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 4).speeds.speed(0) == 0.5
    assert specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 6).speeds.speed(0) == pytest.approx(1 / 3)
    assert specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 2).speeds.speed(0) == 1.0
    # GPU clusters have none
    for path in (ROOT / "exp/clusters").glob("*.yaml"):
        if not path.stem.startswith("cpu"):
            assert specs.load_cluster(path).speeds == specs.NominalSpeeds(), path


def test_host_cores_round_trips_through_the_plan_inputs():
    c = cpu_cluster(2, 4)
    assert c.to_dict()["machines"] == [{"gpu_type": "cpu", "gpus": 4, "host_cores": 2.0}]
    assert specs.cluster_from_dict(c.to_dict()).machines == c.machines
    assert "host_cores" not in cpu_cluster(None).to_dict()["machines"][0]
    assert c.subset({0: 3}).speeds.host_cores[0] == 2.0


@pytest.mark.parametrize("bad", [0, -1, "two", float("nan"), float("inf"), [2]])
def test_bad_host_cores_is_one_error_naming_the_key(bad):
    with pytest.raises(specs.SpecError, match=r"test\.yaml: machines\[0\]\.host_cores must be a number > 0") as e:
        cpu_cluster(bad)
    assert "\n" not in str(e.value)


def test_speed_halves_the_decode_rates_and_stretches_its_overhead():
    model = specs.load_model_spec(TINY)
    te = specs.TypeEfficiency(mfu_infer=0.6, hbm_eff=0.7, decode_overhead_s=0.002)
    for batch, context in ((1, 40.0), (64, 40.0), (64, 400.0)):
        one = cost_model.decode_round_s(model, CPU, te, 1, 1, batch, context, 4, 2.0)
        half = cost_model.decode_round_s(model, CPU, te, 1, 1, batch, context, 4, 2.0, 0.5)
        assert half == pytest.approx(2 * one, rel=1e-12)
        # the formula: the roofline of the halved rates, plus the overhead over the speed
        L = model.layers
        mem = model.layers * model.layer_params * 4 + model.head_params * 4
        mem += batch * context * model.kv_bytes_per_token_layer(4) * L
        flops = batch * (L * model.layer_flops_per_token(context) + 2 * model.head_params)
        want = max(mem / (CPU.hbm_tbps * 1e12 * 0.7 * 0.5), flops / (CPU.tflops * 1e12 * 0.6 * 0.5)) + 0.002 / 0.5
        assert half == pytest.approx(want, rel=1e-12)
    wl = specs.Workload(**DEMO)
    eff = specs.Efficiency(per_type={"cpu": te})
    full, shared = (
        cost_model.replica_cost(model, CPU, 1, 1, wl, eff, 2.0),
        cost_model.replica_cost(model, CPU, 1, 1, wl, eff, 2.0, speed=0.5),
    )
    assert shared.round_s == pytest.approx(2 * full.round_s) and shared.prefill_tflops == full.prefill_tflops / 2
    assert shared.batch == full.batch  # memory is not shared out


def test_speed_halves_the_train_rates_not_the_links():
    model = specs.load_model_spec(TINY)
    wl = specs.Workload(**DEMO)
    eff = specs.Efficiency(per_type={"cpu": specs.TypeEfficiency(mfu_train=0.4, hbm_eff=0.7, train_overhead_s=0.05)})

    def train(dp: int, speed: float) -> float:
        return cost_model.train_step_seconds(model, [cost_model.StageSpec("cpu", 4, (0,), 2.0, 2.0, 0.0, speed)], dp, 1,
                                     {"cpu": CPU}, wl, eff)  # fmt: skip

    assert train(1, 0.5) == pytest.approx(2 * train(1, 1.0), rel=1e-12)  # dp 1: no link in the step
    params = 4 * model.layer_params + model.head_params
    all_reduce = wl.ppo_minibatches * (cost_model.LINK_LATENCY_S + 2 * (2 - 1) / 2 * params * 4 / 2e9)
    assert train(2, 0.5) - all_reduce == pytest.approx(2 * (train(2, 1.0) - all_reduce), rel=1e-12)


def test_speed_stretches_the_weight_sync():
    buckets = sync_layout.sync_buckets(sync_layout.hf_param_table(specs.load_model_spec(TINY)), [(0, 4)], 4, 64 * 2**20)
    eff = specs.Efficiency(link_eff=0.3, sync_latency_s=0.004)
    one = cost_model.sync_seconds(buckets, {0: 2}, [[0, 0]], lambda a, b: 2.0, eff)
    assert cost_model.sync_seconds(buckets, {0: 2}, [[0, 0]], lambda a, b: 2.0, eff, 0.5) == pytest.approx(2 * one)
    total = sum(b.wire_bytes for b in buckets)
    assert len(buckets) == 1  # the relay receives the one bucket, then forwards it to its machine-mate
    assert one == pytest.approx(0.004 + 2 * total / 2e9 / 0.3)


def demo_split(cluster: specs.Cluster, eta: int = 4) -> tuple[search.Planner, search.Evaluation]:
    """The CPU demo's split on `cluster`: dp 2 trainers, two TP-1 rollout replicas."""
    wl = specs.Workload(**{**DEMO, "eta": eta})
    p = search.Planner(cluster, specs.load_model_spec(TINY), wl, specs.Efficiency(sync_latency_s=0.01), forced_layout=(2, 1, 1),
                   rollout_tp=1)  # fmt: skip
    return p, p.evaluate((2,) + (0,) * (len(cluster.machines) - 1))


def seen_while_working(
    ev: search.Evaluation, train_gpus: int, rollout_gpus: int, reward_s: float = 0.0, eta: int = 4
) -> dict:
    """Devices busy at once while one of each role works, by the formula for one machine of dp trainers (one stage)
    and TP-1 replicas: each side's busy time (its work and its part of the sync: the trainers' sends, the replicas'
    until they hold the version) over the step; a role's own devices all work together, the other role's by its
    busy fraction (eta > 0) or not at all (eta = 0)."""
    step = ev.step_s
    train = min(1.0, (ev.train_s + ev.train_sync_s) / step)
    rollout = min(1.0, (ev.rollout_s + reward_s + ev.sync_s) / step)
    overlap = 1.0 if eta > 0 else 0.0
    return {
        "train": train_gpus + overlap * rollout_gpus * rollout,
        "rollout": rollout_gpus + overlap * train_gpus * train,
    }


def test_a_pipeline_trainer_counts_busy_for_its_work_not_its_bubble():
    """Train dp 1 x pp 2 beside one rollout replica on 3 processes: each stage's process is busy for its own
    micro-batches and optimizer work (cost_model.train_step_times) and the train side's sync, not for the whole
    train step. While one stage works the other works only as much as the train step's span forces (1F1B: both in
    the steady phase, one alone in the other's bubble), so a stage sees fewer devices busy than if the two stages
    always worked together; the replica sees both stages by their busy fractions."""
    wl = specs.Workload(**{**DEMO, "microbatch_tokens": 1024, "ppo_minibatches": 1})
    p = search.Planner(cpu_cluster(2, 3), specs.load_model_spec(TINY), wl, specs.Efficiency(sync_latency_s=0.01),
                   forced_layout=(1, 1, 2), rollout_tp=1)  # fmt: skip
    ev = p.evaluate((2,))
    assert ev.train.pp == 2 and len(ev.train.stage_busy_s) == 2
    step, rollout = ev.step_s, min(1.0, (ev.rollout_s + ev.sync_s) / ev.step_s)
    w0, w1 = ev.train.stage_busy_s
    assert max(w0, w1) < ev.train_s < w0 + w1  # each stage idles in its bubble; the two overlap
    both = w0 + w1 - ev.train_s
    seen = [1 + both / w0 + rollout, 1 + both / w1 + rollout]
    by_stage = sum(min(1.0, (w + ev.train_sync_s) / step) for w in (w0, w1))
    assert ev.host_pricing["busy_devices"][0]["train"] == pytest.approx(sum(seen) / 2, rel=1e-3)  # the fixed point
    assert ev.host_pricing["busy_devices"][0]["rollout"] == pytest.approx(1 + by_stage, rel=1e-3)
    assert ev.host_pricing["busy_devices"][0]["train"] < 2 + rollout


def test_speed_counts_the_busy_devices_given():
    c = cpu_cluster(2, 4)
    seen = c.speeds.with_busy_devices({0: {"train": 2.5, "rollout": 3.2}})
    assert seen.speed(0, "compute", "train") == pytest.approx(2 / 2.5)
    assert seen.speed(0, "bandwidth", "rollout") == pytest.approx(2 / 3.2)
    assert seen.speed(0) == pytest.approx(2 / 3.2)  # no role: the busier view
    assert seen.type_speed("cpu", "compute", "train") == pytest.approx(2 / 2.5)
    assert seen.decode_speed("cpu") == pytest.approx(2 / 3.2)  # a replica decodes in the rollout role
    assert (
        c.speeds.with_busy_devices({0: {"train": 1.5, "rollout": 1.5}}).speed(0, "compute", "train") == 1.0
    )  # a core each
    assert c.speeds.with_busy_devices({0: 3.2}).speed(0, "compute", "train") == pytest.approx(2 / 3.2)  # a number: both
    assert c.speeds.with_busy_devices({0: 3.2}).speed(0, "compute", "rollout") == pytest.approx(2 / 3.2)
    assert (
        c.speeds.speed(0, "compute", "train") == 0.5 and c.speeds.busy_devices == {}
    )  # without an estimate every device is busy
    assert cpu_cluster(None, 4).speeds.speed(0) == 1.0  # no host_cores: no sharing, whatever is busy
    with pytest.raises(ValueError, match="role 'trainer'"):
        seen.speed(0, "compute", "trainer")


@pytest.mark.parametrize("eta", [0, 4])
def test_a_shared_machine_is_priced_at_the_cores_over_the_devices_busy_while_one_works(eta):
    """Each role's times are the unshared ones over its core share, host_cores / (devices busy while one of the
    role works); those are of the step priced (the fixed point: the DP all-reduce, a link, is not shared out, so
    the busy fractions move a little with the share). A replica busy part of the step decodes beside both
    trainers and the other replica, so it gets less of a core than a trainer. At eta = 0 the two sides take
    turns: each sees only its own role's devices, 2 on 2 cores, a core each."""
    _, plain = demo_split(cpu_cluster(None), eta)
    p, shared = demo_split(cpu_cluster(2), eta)
    busy = shared.host_pricing["busy_devices"][0]
    step = shared.step_s
    train = min(1.0, (shared.train_s + shared.train_sync_s) / step)
    rollout = min(1.0, (shared.rollout_s + shared.sync_s) / step)
    overlap = 1.0 if eta > 0 else 0.0
    assert busy["train"] == pytest.approx(2 + overlap * 2 * rollout, rel=1e-3)  # the fixed point
    assert busy["rollout"] == pytest.approx(2 + overlap * 2 * train, rel=1e-3)
    share = {role: min(1.0, 2 / b) for role, b in busy.items()}
    if eta == 0:
        assert share == {"train": 1.0, "rollout": 1.0}
    else:
        assert 0.5 <= share["rollout"] < share["train"] < 1.0
    assert shared.rollout_s == pytest.approx(plain.rollout_s / share["rollout"], rel=1e-9)
    # the sync's hops run at the slower end's share
    assert shared.sync_s == pytest.approx(plain.sync_s / min(share.values()), rel=1e-9)
    # the train step stretches but for its DP all-reduce
    params = 4 * specs.load_model_spec(TINY).layer_params + specs.load_model_spec(TINY).head_params
    all_reduce = DEMO["ppo_minibatches"] * (cost_model.LINK_LATENCY_S + params * 4 / 2e9)
    assert shared.train_s - all_reduce == pytest.approx((plain.train_s - all_reduce) / share["train"], rel=1e-9)


def test_a_replica_is_priced_beside_what_runs_while_it_decodes():
    """The CPU demo's split, eta 4: a replica works a part of the step, but while it decodes the trainers and the
    other replica are busy, so it sees more devices busy than the machine's mean (the sum of every device's busy
    fraction), and the trainers, which see the replicas for their busy part, fewer. Pricing every device at the
    mean would give the replicas more of a core than they get and so the trainers too."""
    _, ev = demo_split(cpu_cluster(2), 4)
    step = ev.step_s
    mean = 2 * min(1.0, (ev.train_s + ev.train_sync_s) / step) + 2 * min(1.0, (ev.rollout_s + ev.sync_s) / step)
    assert ev.host_pricing["busy_devices"][0]["rollout"] > mean > 2
    assert ev.host_pricing["busy_devices"][0]["train"] == pytest.approx(
        mean, rel=0.05
    )  # the trainers are busy nearly all of it


def test_the_side_that_bounds_the_step_is_busy_all_of_it():
    """A rollout slower than training: the rollout ranks are busy the whole step, the trainers for their part."""
    slow_decode = specs.Efficiency(sync_latency_s=0.01, per_type={"cpu": specs.TypeEfficiency(decode_overhead_s=0.6)})
    p = search.Planner(cpu_cluster(2), specs.load_model_spec(TINY), specs.Workload(**DEMO), slow_decode,
                   forced_layout=(2, 1, 1), rollout_tp=1)  # fmt: skip
    ev = p.evaluate((2,))
    assert ev.rollout_s > ev.train_s
    trainers = 2 * (ev.train_s + ev.sync_s) / ev.step_s
    assert ev.host_pricing["busy_devices"][0]["train"] == pytest.approx(4.0, rel=1e-3)  # the replicas never rest
    assert (
        ev.host_pricing["busy_devices"][0]["rollout"] == pytest.approx(2 + trainers, rel=1e-3) and 2 < 2 + trainers < 4
    )


def test_core_shares_settle_on_machines_of_different_loads():
    """Two CPU machines, one all trainers and one all rollout: each machine's share from its own busy devices,
    and the evaluation's busy devices are those of the step it prices (the fixed point, within the rounds)."""
    cpu = {"hbm_gb": 2, "tflops": 0.02, "hbm_tbps": 0.005, "dollars_per_hour": 0.05, "intra_gbps": 2.0}
    doc = {
        "name": "two",
        "gpu_types": {"cpu": cpu},
        "machines": [{"gpu_type": "cpu", "gpus": 2, "host_cores": 1}, {"gpu_type": "cpu", "gpus": 2, "host_cores": 1}],
        "links": {"inter_gbps": {"cpu-cpu": 1.0}},
    }
    cluster = specs.cluster_from_dict(doc, "two.yaml")
    p = search.Planner(cluster, specs.load_model_spec(TINY), specs.Workload(**DEMO), specs.Efficiency(sync_latency_s=0.01),
                   forced_layout=(2, 1, 1), rollout_tp=1)  # fmt: skip
    ev = p.evaluate((2, 0))
    assert set(ev.host_pricing["busy_devices"]) == {0, 1}
    settled = host.busy_devices(p, ev)
    for m in (0, 1):
        assert settled[m].keys() == ev.host_pricing["busy_devices"][m].keys()
        for role, busy in settled[m].items():
            assert busy == pytest.approx(ev.host_pricing["busy_devices"][m][role], rel=1e-2), (m, role)
    step = ev.step_s
    assert ev.host_pricing["busy_devices"] == {
        0: {"train": 2.0},
        1: {"rollout": 2.0},
    }  # each role alone, its devices in lockstep
    assert 0 < ev.rollout_s + ev.sync_s < step and 0 < ev.train_s < step  # though each waits part of the step
    priced = cluster.speeds.with_busy_devices(ev.host_pricing["busy_devices"])
    assert priced.speed(0, "compute", "train") == 0.5 and priced.speed(1, "bandwidth", "rollout") == 0.5
    assert priced.type_speed("cpu", "compute", "rollout") == 0.5  # of the machines where the role runs


def test_plans_keep_their_core_shares_through_the_plan_json():
    model, wl, eff = specs.load_model_spec(TINY), specs.Workload(**DEMO), specs.Efficiency(sync_latency_s=0.01)
    shared = schedule.plan(cpu_cluster(2), model, wl, eff)
    busy = shared["predicted"]["busy_devices"]["0"]
    assert set(busy) == set(host.ROLES) and all(2 < b <= 4 for b in busy.values())
    assert "busy_devices" not in schedule.plan(cpu_cluster(None), model, wl, eff)["predicted"]
    p, counts = schedule.planner_from_plan(shared)  # the plan's inputs keep host_cores, not the estimate
    assert p.cluster.speeds.busy_devices == {} and p.evaluate(counts).step_s == pytest.approx(
        shared["predicted"]["step_s"]
    )


# ----------------------------------------------------------------------------- train overhead, decode rate


@pytest.mark.parametrize("minibatches, pp", [(1, 1), (4, 1), (2, 2)])
def test_train_overhead_adds_exactly_overhead_times_minibatches(minibatches, pp):
    model = specs.load_model_spec(TINY)
    wl = specs.Workload(**{**DEMO, "ppo_minibatches": minibatches})
    stages = [cost_model.StageSpec("cpu", lk, (0,), 2.0, 2.0, 2.0 if k < pp - 1 else 0.0) for k, lk in
              enumerate(cost_model.layer_counts(model.layers, pp))]  # fmt: skip

    def train(overhead: float, stages=stages) -> float:
        eff = specs.Efficiency(per_type={"cpu": specs.TypeEfficiency(train_overhead_s=overhead)})
        return cost_model.train_step_seconds(model, stages, 1, 1, {"cpu": CPU}, wl, eff)

    assert train(0.25) - train(0.0) == pytest.approx(0.25 * minibatches, rel=1e-9)
    half = [replace(s, speed=0.5) for s in stages]
    assert train(0.25, half) - train(0.0, half) == pytest.approx(0.5 * minibatches, rel=1e-9)  # host time, shared


def test_decode_compute_rate_is_mfu_decode_else_mfu_infer():
    model = specs.load_model_spec(TINY)
    batch, context = 64, 20.0  # compute-bound on these rates
    base = specs.TypeEfficiency(mfu_infer=0.6, hbm_eff=0.9)
    assert base.decode_mfu == 0.6
    t_infer = cost_model.decode_round_s(model, CPU, base, 1, 1, batch, context, 4, 2.0)
    slow = specs.TypeEfficiency(mfu_infer=0.6, hbm_eff=0.9, mfu_decode=0.2)
    t_decode = cost_model.decode_round_s(model, CPU, slow, 1, 1, batch, context, 4, 2.0)
    flops = batch * (model.layers * model.layer_flops_per_token(context) + 2 * model.head_params)
    assert t_infer == pytest.approx(flops / (CPU.tflops * 1e12 * 0.6))
    assert t_decode == pytest.approx(flops / (CPU.tflops * 1e12 * 0.2))
    # prefill keeps mfu_infer
    wl = specs.Workload(**DEMO)
    for te in (base, slow):
        assert cost_model.replica_cost(
            model, CPU, 1, 1, wl, specs.Efficiency(per_type={"cpu": te}), 2.0
        ).prefill_tflops == (pytest.approx(CPU.tflops * 0.6))


def test_workload_train_passes_reaches_the_cli_and_is_checked(tmp_path):
    with pytest.raises(specs.SpecError, match="train_passes must be > 0"):
        specs.Workload(train_passes=0)
    out = tmp_path / "plan.json"
    args = ["--cluster", "exp/clusters/cpu.yaml", "--model", str(TINY), "--nproc", "4", "--quiet", "--out", str(out)]
    assert schedule.main([*args, "--train-passes", "3"]) == 0
    three = json.loads(out.read_text())
    assert three["inputs"]["workload"]["train_passes"] == 3.0
    assert schedule.main(args) == 0
    assert json.loads(out.read_text())["predicted"]["train_s"] > three["predicted"]["train_s"]


# ----------------------------------------------------------------------------- the profile's new keys


def synthetic_points(bw=4e9, overhead=0.002, decode_rate=3e10, prefill=6e10, train=5e10, c_train=0.3, opt_steps=2,
                     params=3_000_000, link=8e8, latency=1e-4) -> dict:  # fmt: skip
    """A profile's raw points made from known constants (device_profile.profile_device's structure)."""
    memory = [{"batch": 1, "bytes": b, "flops": 1e6, "step_s": b / bw + overhead} for b in (1.2e7, 1.3e7, 8e7, 8.8e7)]
    compute = [{"batch": 64, "bytes": 2e7, "flops": f, "step_s": f / decode_rate + overhead} for f in (4e8, 8e8, 1.6e9)]
    return {
        "device": "synthetic",
        "gemm_tflops": 0.1,
        "copy_tbps": 0.01,
        "decode": memory + compute,
        "prefill": [{"flops": f, "step_s": f / prefill + 0.01} for f in (1e9, 4e9, 9e9)],
        "train": [
            {"flops": f, "step_s": f / train + c_train, "optimizer_steps": opt_steps, "params": params}
            for f in (4e10, 8e10, 1.6e11)
        ],
        "link": {
            "latency_s": latency,
            "points": [{"bytes": n, "hop_s": n / link + latency} for n in (1e6, 4e6, 1.6e7)],
        },
    }


def test_finish_profile_fits_the_new_constants_from_synthetic_points():
    bw, overhead, rate, c_train, params = 4e9, 0.002, 3e10, 0.3, 3_000_000
    out = profile_fit.finish_profile(
        synthetic_points(), specs.GPUType("cpu", 2, 0.1, 0.01, 0.05, 2.0), log=lambda *_: None
    )
    e, m = out["efficiency"], out["measured"]
    assert e["hbm_eff"] == pytest.approx(bw / 1e10) and e["decode_overhead_s"] == pytest.approx(overhead)
    assert e["mfu_decode"] == pytest.approx(rate / 1e11)  # the compute-bound points, through the same overhead
    assert m["decode_compute_points"] == 3 and m["decode_fit_points"] == 4
    assert m["train_overhead_s"] == pytest.approx(c_train)  # per profiled Trainer step (2 optimizer steps)
    optimizer = params * profile_fit.OPTIMIZER_BYTES_DP1 / bw
    assert e["train_overhead_s"] == pytest.approx(c_train / 2 - optimizer)
    assert out["sync"] == {"link_gbps": pytest.approx(0.8), "sync_latency_s": 1e-4}
    profile_fit.profile_from_dict({**out, "gpu_type": "cpu"}, "p")  # what the planner reads back


def test_a_step_packed_finer_gives_the_micro_batch_overhead_and_the_cost_model_charges_it_per_micro_batch():
    """The train line goes through the one-micro-batch steps; the same FLOPs packed into 4 micro-batches per minibatch
    cost 3 x optimizer_steps x c more: finish_profile recovers c, takes it out of the per-optimizer-step intercept
    (which held one micro-batch's), and train_step_seconds charges it to every micro-batch: at one micro-batch per
    minibatch the step is what it was without the split point."""
    c_mb, rate, c_train = 0.004, 5e10, 0.3
    pts = synthetic_points()
    pts["train"].append({"flops": 1.6e11, "step_s": 1.6e11 / rate + c_train + 3 * 2 * c_mb, "optimizer_steps": 2,
                         "params": 3_000_000, "microbatches": 4})  # fmt: skip
    gpu = specs.GPUType("cpu", 2, 0.1, 0.01, 0.05, 2.0)
    out = profile_fit.finish_profile(pts, gpu, log=lambda *_: None)
    plain = profile_fit.finish_profile(synthetic_points(), gpu, log=lambda *_: None)
    e = out["efficiency"]
    assert e["microbatch_overhead_s"] == pytest.approx(c_mb) and "microbatch_overhead_s" not in plain["efficiency"]
    assert e["train_overhead_s"] == pytest.approx(plain["efficiency"]["train_overhead_s"] - c_mb)
    model = specs.load_model_spec(TINY)
    stage = [cost_model.StageSpec("cpu", model.layers, (0,), 2.0, 2.0, 0.0)]

    def train(eff: dict, microbatch_tokens: int) -> float:
        te = specs.TypeEfficiency(**{k: v for k, v in eff.items()})
        wl = specs.Workload(**{**DEMO, "ppo_minibatches": 2, "microbatch_tokens": microbatch_tokens})
        return cost_model.train_step_seconds(
            model, stage, 1, 1, {"cpu": gpu}, wl, specs.Efficiency(per_type={"cpu": te})
        )

    one = 16 * 8 * (29 + 25.5)  # the step: a minibatch (half of it) in one micro-batch of these tokens
    assert train(e, int(one)) == pytest.approx(train(plain["efficiency"], int(one)), rel=1e-9)
    # 4 micro-batches per minibatch: 3 more fixed parts in each of the 2 minibatches
    assert train(e, int(one / 8) + 1) - train(plain["efficiency"], int(one / 8) + 1) == pytest.approx(2 * 3 * c_mb)


def test_finish_profile_keeps_the_decode_form_the_points_fit():
    """Points made by a serialised step (bytes / bw + FLOPs / rate + c), one row to a full batch: the fit picks
    decode_combine "sum" and recovers its constants; the max-made points above keep "max" (no key written)."""
    bw, rate, c = 4e9, 3e10, 0.002
    pts = synthetic_points()
    shapes = [(1, 1.2e7, 1e6), (1, 8e7, 7e6), (8, 1.3e7, 8e6), (64, 1.3e7, 1e8), (64, 2e7, 4e8), (64, 8.5e7, 1.6e9)]
    pts["decode"] = [{"batch": n, "bytes": b, "flops": f, "step_s": b / bw + f / rate + c} for n, b, f in shapes]
    gpu = specs.GPUType("cpu", 2, 0.1, 0.01, 0.05, 2.0)
    out = profile_fit.finish_profile(pts, gpu, log=lambda *_: None)
    e, m = out["efficiency"], out["measured"]
    assert e["decode_combine"] == m["decode_combine"] == "sum"
    assert e["hbm_eff"] == pytest.approx(bw / 1e10) and e["mfu_decode"] == pytest.approx(rate / 1e11)
    assert e["decode_overhead_s"] == pytest.approx(c) and m["decode_rel_rms_sum"] == pytest.approx(0.0, abs=1e-9)
    assert m["decode_rel_rms_max"] > 0.05
    assert e.get("decode_multirow_s", 0.0) == pytest.approx(0.0, abs=1e-9)  # no more for more rows: none fitted
    prof = profile_fit.profile_from_dict({**out, "gpu_type": "cpu"}, "p")
    assert prof.efficiency.decode_combine == "sum"
    applied = profile_fit.apply_profile(specs.Efficiency(), cpu_cluster(), prof, "p").of("cpu")
    assert applied.decode_combine == "sum"  # rescaled to the cluster's nominal numbers, the form kept
    plain = profile_fit.finish_profile(synthetic_points(), gpu, log=lambda *_: None)
    assert "decode_combine" not in plain["efficiency"] and plain["measured"]["decode_combine"] == "max"


def serialised_decode_points(multirow_s: float, bw=4e9, rate=3e10, c=0.002) -> list[dict]:
    """Decode points of a serialised step (bytes / bw + FLOPs / rate + c) whose steps of more than one row cost
    `multirow_s` more: one-row steps on three models and a few contexts, wider ones on two."""
    shapes = [(1, 1.2e7, 1e6), (1, 1.25e7, 1.1e6), (1, 8e7, 7e6), (1, 8.2e7, 7.2e6), (1, 6e5, 4e5),
              (8, 1.3e7, 8e6), (64, 1.8e7, 4e8), (64, 2.2e7, 4.1e8), (8, 8.5e7, 6e7), (64, 9.7e7, 2.5e9)]  # fmt: skip
    return [
        {"batch": n, "bytes": b, "flops": f, "step_s": b / bw + f / rate + c + (multirow_s if n > 1 else 0.0)}
        for n, b, f in shapes
    ]


def test_a_multi_row_steps_fixed_part_is_fitted_charged_above_one_row_and_checked(tmp_path):
    """Points whose steps of more than one row cost 1.5 ms more (a core's GEMM path against its one-row
    matrix-vector path): finish_profile recovers that part beside the serialised step's constants, the profile
    carries it to the cluster's type, and decode_round_s charges it to every step of more than one row, stretched by
    a replica's share of the device like the per-step overhead. A fit whose part comes out negative leaves it out;
    a profile that gives a negative one is refused."""
    bw, rate, c, extra = 4e9, 3e10, 0.002, 0.0015
    pts = synthetic_points()
    pts["decode"] = serialised_decode_points(extra, bw, rate, c)
    gpu = specs.GPUType("cpu", 2, 0.1, 0.01, 0.05, 2.0)
    out = profile_fit.finish_profile(pts, gpu, log=lambda *_: None)
    e, m = out["efficiency"], out["measured"]
    assert e["decode_combine"] == "sum" and m["decode_rel_rms_sum"] == pytest.approx(0.0, abs=1e-9)
    assert e["decode_multirow_s"] == pytest.approx(extra) and m["decode_multirow_s"] == pytest.approx(extra)
    assert e["hbm_eff"] == pytest.approx(bw / 1e10) and e["mfu_decode"] == pytest.approx(rate / 1e11)
    assert e["decode_overhead_s"] == pytest.approx(c)
    te = profile_fit.apply_profile(
        specs.Efficiency(), cpu_cluster(), profile_fit.profile_from_dict({**out, "gpu_type": "cpu"}, "p"), "p"
    )
    te = te.of("cpu")
    assert te.decode_multirow_s == pytest.approx(extra)
    model, cluster_gpu = specs.load_model_spec(TINY), cpu_cluster().gpu("cpu")
    without = replace(te, decode_multirow_s=0.0)
    for batch, speed in ((1, 1.0), (2, 1.0), (64, 1.0), (1, 0.5), (8, 0.5)):
        args = (model, cluster_gpu)
        rest = (1, 1, batch, 40.0, 4, 1.0, speed)
        more = cost_model.decode_round_s(*args, te, *rest) - cost_model.decode_round_s(*args, without, *rest)
        assert more == pytest.approx(extra / speed if batch > 1 else 0.0, abs=1e-12)
    # steps of more rows no slower than the line of one-row steps: the part would be < 0, the fit leaves it out
    pts["decode"] = serialised_decode_points(-0.0005, bw, rate, c)
    faster = profile_fit.finish_profile(pts, gpu, log=lambda *_: None)
    assert "decode_multirow_s" not in faster["efficiency"] and faster["measured"]["decode_multirow_s"] == 0.0
    with pytest.raises(
        specs.SpecError, match=r"p\.yaml: efficiency\.decode_multirow_s = -0\.001 s < 0 is not physically"
    ):
        profile_fit.load_profile(write(tmp_path, profile_doc(decode_multirow_s=-0.001), "p.yaml"))


def test_refit_fits_a_stored_profile_again_with_this_version(tmp_path, capsys):
    """`schedule.py profile --refit`: the stored points, fitted again, whatever constants the file held."""
    pts = synthetic_points()
    gpu = specs.GPUType("cpu", 2, 0.1, 0.01, 0.05, 2.0)
    fitted = profile_fit.finish_profile(dict(pts), gpu, log=lambda *_: None)
    doc = {"device": "synthetic", "gpu_type": "cpu", "nominal": fitted["nominal"], "seconds": 1.0, "points": pts}
    doc["efficiency"] = {**fitted["efficiency"], "hbm_eff": 0.01, "decode_overhead_s": 0.5}  # an older fit's
    old, new = write(tmp_path, doc, "old.yaml"), tmp_path / "new.yaml"
    assert schedule.main(["profile", "--refit", str(old), "--out", str(new)]) == 0
    refitted = yaml.safe_load(new.read_text())
    assert refitted["efficiency"] == pytest.approx(fitted["efficiency"]) and refitted["refitted_from"] == str(old)
    assert yaml.safe_load(old.read_text())["efficiency"]["hbm_eff"] == 0.01  # the measured file is left alone
    assert schedule.main(["profile", "--refit", str(old)]) != 0
    assert "--refit needs --out" in capsys.readouterr().err
    bare = write(tmp_path, {**doc, "points": {}}, "bare.yaml")
    assert schedule.main(["profile", "--refit", str(bare), "--out", str(new)]) != 0
    assert "no stored points to refit" in capsys.readouterr().err


def test_decode_combine_reaches_the_decode_step_and_is_checked(tmp_path):
    model = specs.load_model_spec(TINY)
    gpu = cpu_cluster().gpu("cpu")
    te = specs.TypeEfficiency(mfu_infer=0.5, hbm_eff=0.5, decode_overhead_s=0.001)
    summed = replace(te, decode_combine="sum")
    memory = cost_model.decode_bytes_per_step(model, 8, 40.0, 4) / (gpu.hbm_tbps * 1e12 * 0.5)
    compute = 8 * (model.layers * model.layer_flops_per_token(40.0) + 2 * model.head_params) / (gpu.tflops * 1e12 * 0.5)
    args = (model, gpu, 1, 1, 8, 40.0, 4, 1.0)
    assert cost_model.decode_round_s(args[0], args[1], te, *args[2:]) == pytest.approx(max(memory, compute) + 0.001)
    assert cost_model.decode_round_s(args[0], args[1], summed, *args[2:]) == pytest.approx(memory + compute + 0.001)
    with pytest.raises(specs.SpecError, match="decode_combine must be one of"):
        specs.TypeEfficiency(decode_combine="avg")
    with pytest.raises(specs.SpecError, match=r"p\.yaml: efficiency\.decode_combine must be one of \['max', 'sum'\]"):
        profile_fit.load_profile(write(tmp_path, profile_doc(decode_combine="avg"), "p.yaml"))


def test_finish_profile_train_overhead_is_what_the_optimizer_term_leaves():
    gpu = specs.GPUType("cpu", 2, 0.1, 0.01, 0.05, 2.0)
    # an intercept smaller than the optimizer term (0.5 ms per step < 375 ms of optimizer bytes): nothing to add
    covered = profile_fit.finish_profile(synthetic_points(c_train=0.001, params=50_000_000), gpu, log=lambda *_: None)
    assert covered["efficiency"]["train_overhead_s"] == 0.0
    # a negative intercept is a noisy fit: refused
    with pytest.raises(specs.SpecError, match=r"efficiency\.train_overhead_s = -0\.\d+ s < 0 is not physically"):
        profile_fit.finish_profile(synthetic_points(c_train=-0.05), gpu, log=lambda *_: None)


def test_profile_with_the_new_keys_round_trips_and_is_applied(tmp_path):
    doc = profile_doc(train_overhead_s=0.03, mfu_decode=0.3)
    doc["sync"] = {"link_gbps": 0.5, "sync_latency_s": 0.002}
    prof = profile_fit.load_profile(write(tmp_path, doc))
    assert prof == profile_fit.DeviceProfile(
        "cpu", specs.TypeEfficiency(0.4, 0.6, 0.7, 0.002, 0.03, 0.3), 0.02, 0.005, 0.5, 0.002
    )
    cluster = specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 4)
    eff = profile_fit.apply_profile(specs.Efficiency(), cluster, prof, "p.yaml")
    assert eff.of("cpu") == prof.efficiency
    assert eff.link_eff == pytest.approx(0.5 / 2.0) and eff.sync_latency_s == 0.002  # cpu.yaml: intra_gbps 2
    other = profile_fit.apply_profile(
        specs.Efficiency(), cluster, profile_fit.DeviceProfile("cpu", prof.efficiency, 0.1, 0.01), "p"
    )
    assert other.of("cpu").mfu_decode * 0.02 == pytest.approx(0.3 * 0.1)  # rescaled like mfu_infer
    assert other.link_eff == specs.Efficiency().link_eff  # no sync section: the cluster's constants stay
    # an older profile without the new keys: the defaults (no overhead, mfu_decode = mfu_infer)
    old = profile_fit.load_profile(write(tmp_path, profile_doc(), "old.yaml"))
    assert old.efficiency.train_overhead_s == 0.0 and old.efficiency.mfu_decode is None and old.link_gbps is None
    # the plan records them and reads them back
    out = tmp_path / "plan.json"
    args = ["--cluster", "exp/clusters/cpu.yaml", "--model", str(TINY), "--nproc", "4", "--quiet", "--out", str(out)]
    assert schedule.main([*args, "--profile", str(tmp_path / "p.yaml")]) == 0
    pj = json.loads(out.read_text())
    assert pj["inputs"]["efficiency"]["per_type"]["cpu"]["train_overhead_s"] == 0.03
    assert pj["inputs"]["efficiency"]["sync_latency_s"] == 0.002
    p, counts = schedule.planner_from_plan(pj)
    assert p.eff.of("cpu") == prof.efficiency and p.evaluate(counts).step_s == pytest.approx(pj["predicted"]["step_s"])


def demo_eval(tmp_path: Path, name: str, host_cores=2, **changes) -> search.Evaluation:
    """The CPU demo's split (2 train ranks dp 2, 2 TP-1 rollout replicas) priced with a profile changed."""
    doc = profile_doc(train_overhead_s=0.03, mfu_decode=0.3)
    doc["sync"] = {"link_gbps": 0.5, "sync_latency_s": 0.002}
    for key, value in changes.items():
        (doc["sync"] if key in doc["sync"] else doc["efficiency"])[key] = value
    cluster = cpu_cluster(host_cores)
    eff = profile_fit.apply_profile(
        specs.Efficiency(), cluster, profile_fit.load_profile(write(tmp_path, doc, f"{name}.yaml")), name
    )
    wl = specs.Workload(**{**DEMO, "gen_samples": [25.5], "prompt_len": 5.0})  # a short prompt: decode-heavy rollout
    p = search.Planner(cluster, specs.load_model_spec(TINY), wl, eff, forced_layout=(2, 1, 1), rollout_tp=1)
    return p.evaluate((2,))


def test_each_new_key_moves_the_prediction(tmp_path):
    """Each key by its formula on devices with a core each (no sharing: host_cores 4 for 4 devices); sharing 2
    cores then stretches every time by the share the busy devices give."""
    base = demo_eval(tmp_path, "base", host_cores=4)
    more_overhead = demo_eval(tmp_path, "overhead", host_cores=4, train_overhead_s=0.13)
    assert more_overhead.train_s - base.train_s == pytest.approx(0.1 * DEMO["ppo_minibatches"])
    slow_decode = demo_eval(tmp_path, "decode", host_cores=4, mfu_decode=0.05)
    assert slow_decode.rollout_s > base.rollout_s and slow_decode.train_s == base.train_s
    slow_link = demo_eval(tmp_path, "link", host_cores=4, link_gbps=0.05)
    assert slow_link.sync_s > 5 * base.sync_s and slow_link.train_s == base.train_s
    late = demo_eval(tmp_path, "latency", host_cores=4, sync_latency_s=0.5)
    assert late.sync_s - base.sync_s == pytest.approx(0.5 - 0.002)
    plain = demo_eval(tmp_path, "plain", host_cores=None)
    for key in ("rollout_s", "sync_s", "train_s", "step_s"):
        assert getattr(base, key) == pytest.approx(getattr(plain, key), rel=1e-12), key  # 4 cores: a core each
    shared = demo_eval(tmp_path, "shared", host_cores=2)
    share = {role: min(1.0, 2 / b) for role, b in shared.host_pricing["busy_devices"][0].items()}
    for role, b in seen_while_working(shared, 2, 2).items():
        assert shared.host_pricing["busy_devices"][0][role] == pytest.approx(b, rel=1e-3), role
    assert shared.rollout_s == pytest.approx(plain.rollout_s / share["rollout"])
    assert shared.sync_s == pytest.approx(plain.sync_s / min(share.values()))
    params = 4 * specs.load_model_spec(TINY).layer_params + specs.load_model_spec(TINY).head_params
    all_reduce = DEMO["ppo_minibatches"] * (cost_model.LINK_LATENCY_S + params * 4 / 2e9)  # dp 2 over gloo: not shared
    assert shared.train_s - all_reduce == pytest.approx((plain.train_s - all_reduce) / share["train"])


@pytest.mark.parametrize(
    "where, key, value, needle",
    [
        ("efficiency", "train_overhead_s", -0.1, "efficiency.train_overhead_s = -0.1 s < 0"),
        ("efficiency", "train_overhead_s", 11.0, "efficiency.train_overhead_s = 11 s > 10 s"),
        ("efficiency", "decode_overhead_s", 20.0, "efficiency.decode_overhead_s = 20 s > 10 s"),
        ("efficiency", "train_overhead_s", "slow", "efficiency.train_overhead_s must be a number"),
        ("efficiency", "mfu_decode", 1.5, "efficiency.mfu_decode = 1.5 is not physically plausible"),
        ("efficiency", "mfu_decode", 0.0, "efficiency.mfu_decode = 0 is not physically plausible"),
        ("sync", "link_gbps", 0.0, "sync.link_gbps = 0 GB/s is not physically plausible"),
        ("sync", "sync_latency_s", -1.0, "sync.sync_latency_s = -1 s < 0"),
        ("sync", "sync_latency_s", None, "'sync' must be a mapping of link_gbps and sync_latency_s"),
    ],
)
def test_a_bad_new_profile_value_is_one_clear_error(tmp_path, where, key, value, needle):
    doc = profile_doc()
    doc["sync"] = {"link_gbps": 0.5, "sync_latency_s": 0.002}
    if value is None:
        doc[where].pop(key)
    else:
        doc[where][key] = value
    with pytest.raises(specs.SpecError) as e:
        profile_fit.load_profile(write(tmp_path, doc))
    assert needle in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- exp/check_profile_prediction.py


def fake_run(tmp_path: Path, step_s: float) -> Path:
    """A run directory shaped like train.py's (config.yaml, metrics.jsonl, plan.json, layout.json) for the CPU
    demo's split, every step `step_s` long; an eval at steps 0 and 10 (the step after each is 3x as long)."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    cfg = {
        "model": {"path": "exp/tiny-model"},
        "data": {"task": "arith", "num_train": 200, "num_test": 10, "seed": 0},
        "rollout": {"samples_per_prompt": 8, "max_batch_size": 64},
        "train": {"prompts_per_step": 16, "ppo_minibatches": 1, "micro_batch_tokens": 1024,
                  "recompute_prox_logprobs": True, "kl_coef": 0.0},
        "staleness": {"max_staleness": 4},
        "dist": {"weight_bucket_mb": 64.0},
    }  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows, elapsed = [{"step": 0, "eval_accuracy": 0.5}], 0.0
    for step in range(1, 21):
        s = step_s * (3 if step in (1, 11) else 1)
        elapsed += s
        rows.append({"step": step, "step_s": s, "train_s": 0.9 * s, "weight_sync_s": 0.02, "response_len_mean": 25.5,
                     "weight_sync_dtype": "float32", "elapsed_s": elapsed, "rollout_idle_frac": 0.3,
                     "trained_tokens": 128 * 25.5, "staleness_mean": 1.5, "loss": 0.0})  # fmt: skip
        if step == 10:
            rows.append({"step": 10, "eval_accuracy": 0.6})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "plan.json").write_text(json.dumps({"world_size": 4, "train": {"dp": 2, "tp": 1, "pp": 1}}))
    layout = [{"rank": r, "role": "train", "replica": None, "node": 0} for r in (0, 1)]
    layout += [{"rank": r, "role": "rollout", "replica": r - 2, "node": 0} for r in (2, 3)]
    (run / "layout.json").write_text(json.dumps(layout))
    return run


def test_check_script_compares_the_steady_steps_with_the_prediction(tmp_path, capsys):
    import check_profile_prediction as chk

    from planner import run_prediction

    prof = write(tmp_path, profile_doc(train_overhead_s=0.03), "p.yaml")
    run = fake_run(tmp_path, 1.0)
    cfg, rows, plan, layout = run_prediction.read_run(run)
    assert [r["step"] for r in run_prediction.steady_steps(rows, 3)] == [s for s in range(4, 21) if s != 11]
    wl = run_prediction.workload(cfg, rows, 29.0)
    assert (wl.train_passes, wl.batch, wl.eta, wl.precision, wl.gen_mean) == (3.0, 128, 4, "fp32", 25.5)
    assert (
        run_prediction.train_passes({"ppo_minibatches": 4}) == 4.0
        and run_prediction.train_passes({"ppo_minibatches": 1}) == 3.0
    )
    assert run_prediction.train_passes({"ppo_minibatches": 4, "recompute_prox_logprobs": False, "kl_coef": 0.1}) == 4.0
    ev, planner = run_prediction.predict(str(ROOT / "exp/clusters/cpu.yaml"), [str(prof)], cfg, plan, layout, wl)
    assert (ev.train.dp, ev.train.tp, ev.train.pp, len(ev.rollout.replicas)) == (2, 1, 1, 2)
    priced = planner.cluster.speeds.with_busy_devices(ev.host_pricing["busy_devices"])
    assert planner.cluster.speeds.speed(0) == 0.5 and 0.5 < priced.speed(0, "compute", "train") < 1
    close = fake_run(tmp_path / "a", ev.step_s * 1.1)
    far = fake_run(tmp_path / "b", ev.step_s * 1.5)
    args = ["--profile", str(prof), "--prompt-len", "29", "--json", str(tmp_path / "c.json")]
    assert chk.main([str(close), *args]) == 0
    assert "step error -9.1% (within 15%)" in capsys.readouterr().out
    got = json.loads((tmp_path / "c.json").read_text())
    assert got["measured"]["step_s"] == pytest.approx(ev.step_s * 1.1) and math.isclose(got["error"], 1 / 1.1 - 1)
    assert chk.main([str(far), *args]) == 1


def test_the_workload_takes_the_runs_length_quantiles_where_it_logged_them(tmp_path):
    """The output lengths are a workload input: the steps' p50 / p90 / max give the distribution (mean kept), whose
    tail an eta = 0 step waits for; a run that did not log them is priced at its mean alone."""

    from planner import run_prediction

    cfg, rows, _, _ = run_prediction.read_run(fake_run(tmp_path, 1.0))
    assert run_prediction.workload(cfg, rows, 29.0).gen_samples == [25.5]
    tailed = [{**r, "response_len_p50": 20, "response_len_p90": 40, "response_len_max": 64} if "step_s" in r else r
              for r in rows]  # fmt: skip
    wl = run_prediction.workload(cfg, tailed, 29.0)
    assert wl.gen_mean == pytest.approx(25.5) and 50 < wl.gen_max <= 64 * 25.5 / 20
    at_eta0 = {**wl.to_dict(), "eta": 0}
    slow_tail = cost_model.rollout_seconds(specs.load_model_spec(TINY), specs.Workload(**at_eta0), 1000.0, 1.0, 10.0)
    no_tail = cost_model.rollout_seconds(specs.load_model_spec(TINY), specs.Workload(**{**at_eta0, "gen_samples": [25.5]}), 1000.0,
                                 1.0, 10.0)  # fmt: skip
    # the longest sequence, not the mean, sets the eta-0 rollout: its rounds at one sequence's rate (10 tokens/s)
    assert slow_tail - no_tail == pytest.approx(wl.gen_max / 10.0 - max(128 * 25.5 / 1000.0, 25.5 / 10.0))


def test_the_simulator_predicts_a_run_from_the_profile_alone(tmp_path):
    """exp/validate_simulator.py --profile: nothing timed in the run reaches the prediction (two runs of the same
    job at different speeds get the same one); the measured side is the steady steps (the one after an
    evaluation left out), and the error is their ratio."""
    import validate_simulator as vs

    prof = str(write(tmp_path, profile_doc(train_overhead_s=0.03), "p.yaml"))
    cluster = str(ROOT / "exp/clusters/cpu.yaml")
    slow, fast = fake_run(tmp_path / "slow", 2.0), fake_run(tmp_path / "fast", 1.0)
    a, b = (vs.predict_run(r, [prof], cluster, warmup=2) for r in (slow, fast))
    assert a["predicted_step_s"] == b["predicted_step_s"] and a["predicted_tokens_per_s"] == b["predicted_tokens_per_s"]
    assert a["measured_step_s"] == pytest.approx(2.0) and b["measured_step_s"] == pytest.approx(1.0)  # step 11 out
    assert b["measured_tokens_per_s"] == pytest.approx(128 * 25.5)
    assert b["step_err"] == pytest.approx(b["predicted_step_s"] - 1.0)
    assert b["fitted_on"] == [prof] and b["layout"] == "dp2 tp1 pp1 + 2 rollout" and b["eta"] == 4
    assert vs.main([str(fast), "--profile", prof, "--out", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())[0]["predicted_step_s"] == b["predicted_step_s"]
