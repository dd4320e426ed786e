"""Emulated device types (cpu_bench/emulation.py): the throttle's arithmetic, its validation, the plan plumbing and the
generator-step split (a throttled pipeline on gloo ranks: tests/dist/test_measured_ranks.py; an emulated run end to
end: tests/e2e/test_e2e.py)."""

import json
import statistics
import sys
import time
import types

import pytest
from tiny import ROOT

import schedule
from cpu_bench import host
from cpu_bench.emulation import Emulation, EmulationError, Throttle, emulated_types
from planner import cost_model, profile_fit, search, specs


def busy(seconds: float) -> None:
    """Spins for `seconds` of wall time (what a link piece is priced by)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cpu_busy(seconds: float) -> None:
    """Burns `seconds` of this thread's CPU time (what a throttle prices), however the host time-slices it."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.alone  # times the wall clock
@pytest.mark.parametrize("kind, fraction", [("compute", 0.5), ("bandwidth", 0.25), ("link", 0.8)])
def test_a_piece_measured_at_t_takes_t_over_the_fraction(kind, fraction):
    throttle = Throttle(Emulation(**{kind: fraction}))
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        with throttle.piece(kind):
            (busy if kind == "link" else cpu_busy)(0.04)  # the clock the throttle prices this kind by
        took.append(time.perf_counter() - t0)
    assert statistics.median(took) == pytest.approx(0.04 / fraction, rel=0.10)
    other = next(k for k in ("compute", "bandwidth", "link") if k != kind)
    assert throttle.pad(other, 0.04) == 0.0  # other kinds run at full speed


@pytest.mark.alone  # times the wall clock
@pytest.mark.parametrize("kind", ["compute", "bandwidth"])
def test_a_work_piece_costs_its_cpu_time_so_sharing_a_core_does_not_slow_it_further(kind):
    """Half of the piece the thread is off the CPU (as when another rank holds the core): the piece still takes
    its CPU time / fraction, not its stretched wall time / fraction."""
    throttle = Throttle(Emulation(**{kind: 0.25}))
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        with throttle.piece(kind):
            cpu_busy(0.02)
            time.sleep(0.02)
        took.append(time.perf_counter() - t0)
    assert statistics.median(took) == pytest.approx(0.02 / 0.25, rel=0.15)


@pytest.mark.alone  # times the wall clock
def test_a_link_piece_is_a_wait_and_costs_its_wall_time():
    """A link piece that sleeps (no CPU) is padded by its wall time, whatever the sleep really took on a loaded
    host: the piece measured at t takes t / fraction."""
    throttle = Throttle(Emulation(link=0.5))
    ratios = []
    for _ in range(5):
        t0 = time.perf_counter()
        with throttle.piece("link"):
            time.sleep(0.03)
            took = time.perf_counter() - t0
        ratios.append((time.perf_counter() - t0) / took)
    assert statistics.median(ratios) == pytest.approx(1 / 0.5, rel=0.10)


@pytest.mark.alone  # times the wall clock
def test_a_wait_inside_a_piece_pads_the_work_before_it_and_is_not_work():
    """work, a wait on another rank, work: each stretch of work takes cpu / fraction when it runs, and the wait
    adds its own length -- the wait neither absorbs the padding (as a piece padded once at its end would let it)
    nor is stretched."""
    throttle = Throttle(Emulation(compute=0.25))
    took, first = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        with throttle.piece("compute"):
            cpu_busy(0.01)
            with throttle.waiting():
                first.append(time.perf_counter() - t0)  # the work before the wait is already padded
                time.sleep(0.04)
            cpu_busy(0.01)
        took.append(time.perf_counter() - t0)
    assert statistics.median(first) == pytest.approx(0.01 / 0.25, rel=0.15)
    assert statistics.median(took) == pytest.approx(2 * 0.01 / 0.25 + 0.04, rel=0.15)
    assert throttle.slept_s["compute"] == pytest.approx(3 * 2 * 0.01 * (1 / 0.25 - 1), rel=0.15)
    t0 = time.perf_counter()
    with throttle.waiting():  # outside a piece: nothing to pad
        time.sleep(0.01)
    assert time.perf_counter() - t0 < 0.01 + 0.02


def test_a_contended_piece_past_its_fraction_is_not_padded():
    throttle = Throttle(Emulation(compute=0.5))
    assert throttle.pad("compute", 0.10, cpu_seconds=0.04) == 0.0  # 0.04 / 0.5 < 0.10 already: only ever slower
    assert throttle.pad("compute", 0.05, cpu_seconds=0.04) == pytest.approx(0.03)


@pytest.mark.alone  # times the wall clock
def test_no_emulation_and_full_speed_are_free():
    for throttle in (Throttle(), Throttle(Emulation())):
        t0 = time.perf_counter()
        with throttle.piece("compute"):
            pass
        assert throttle.pad("bandwidth", 1.0) == 0.0 and time.perf_counter() - t0 < 0.05


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"compute": 0}, "must be in \\(0, 1\\]"),
        ({"bandwidth": 1.5}, "only slows"),
        ({"flops": 0.5}, "unknown emulate keys \\['flops'\\]"),
        ({"link": "fast"}, "must be numbers"),
    ],
)
def test_bad_emulate_entries_are_one_clear_error(spec, needle):
    with pytest.raises(EmulationError, match=needle):
        Emulation.from_dict(spec, "gpu_types.x")


def emulated_cluster(fractions: dict) -> dict:
    return {
        "name": "emulated",
        "gpu_types": {
            "slow": {
                "hbm_gb": 2,
                "tflops": 0.01,
                "hbm_tbps": 0.004,
                "dollars_per_hour": 0.05,
                "intra_gbps": 2.0,
                "emulate": fractions,
            },
        },  # fmt: skip
        "machines": [{"gpu_type": "slow", "gpus": 4}],
        "links": {"inter_gbps": {"slow-slow": 1.0}},
    }


def test_the_plan_carries_the_emulation_to_each_rank():
    cluster = specs.cluster_from_dict(emulated_cluster({"compute": 0.5}))
    assert cluster.speeds.emulated["slow"] == Emulation(compute=0.5)
    again = specs.cluster_from_dict(cluster.to_dict())  # plan JSON round trip
    assert again.speeds.emulated["slow"] == Emulation(compute=0.5)
    plan = {"inputs": {"cluster": cluster.to_dict()}, "ranks": [{"rank": 0, "gpu_type": "slow"}]}
    assert Throttle.for_rank(plan, 0).emulation == Emulation(compute=0.5)
    assert not Throttle.for_rank({"ranks": [{"rank": 0}]}, 0).active  # no cluster in the plan: full speed
    assert emulated_types(plan) == ["slow"]
    plain = specs.load_cluster("exp/clusters/cpu.yaml")
    assert "emulate" not in json.dumps(plain.to_dict())  # shipped clusters unchanged


@pytest.mark.alone  # times the wall clock
def test_a_generator_step_pads_prefill_by_compute_and_the_rest_by_bandwidth():
    from rollout import RolloutWorker

    class Gen:
        stats = types.SimpleNamespace(prefill_seconds=0.0)

        def step(self):
            busy(0.02)
            self.stats.prefill_seconds += 0.02  # a prefill step
            busy(0.03)  # then decode
            return ["out"]

    worker = RolloutWorker.__new__(RolloutWorker)
    throttle = Throttle(Emulation(compute=0.5, bandwidth=0.25))
    worker.run_step, worker.generate_s = throttle.generator_step, 0.0  # as cpu_bench.wrap_rank sets it
    worker.generate_cpu_s, worker.generate_steps = 0.0, 0
    assert worker.step(Gen()) == ["out"]
    assert worker.generate_s == pytest.approx(0.16, rel=0.15)  # the step's wall time, padding included
    assert worker.generate_cpu_s == pytest.approx(0.05, rel=0.3)  # its work, not its padding
    assert worker.generate_steps == 1
    assert throttle.slept_s["compute"] == pytest.approx(0.02, rel=0.15)  # ~0.02 * (1/0.5 - 1)
    assert throttle.slept_s["bandwidth"] == pytest.approx(0.09, rel=0.15)  # ~0.03 * (1/0.25 - 1)


# -- the planner prices an emulated type at its fractions (specs.Cluster.speed) -----------------------------


def two_type_cluster(host_cores: float | None = 1) -> specs.Cluster:
    base = {"hbm_gb": 2, "tflops": 0.02, "hbm_tbps": 0.005, "dollars_per_hour": 1.0, "intra_gbps": 2.0}
    cores = {} if host_cores is None else {"host_cores": host_cores}
    return specs.cluster_from_dict(
        {
            "name": "two",
            "gpu_types": {
                "bw": {**base, "emulate": {"compute": 0.25, "bandwidth": 0.5}},
                "fl": {**base, "emulate": {"compute": 0.5, "bandwidth": 0.2, "link": 0.4}},
                "cpu": base,
            },
            "machines": [
                {"gpu_type": "bw", "gpus": 2, **cores},
                {"gpu_type": "fl", "gpus": 2, **cores},
                {"gpu_type": "cpu", "gpus": 4, **({"host_cores": 2} if host_cores is not None else {})},
            ],
            "links": {
                "inter_gbps": {"bw-bw": 1.0, "bw-fl": 1.0, "fl-fl": 1.0, "bw-cpu": 1.0, "cpu-fl": 1.0, "cpu-cpu": 1}
            },
        }
    )


def test_cluster_speed_is_the_kinds_fraction_times_a_core_share_by_demand():
    c = two_type_cluster(host_cores=1)
    # two ranks wanting at most half a core each fit in one core: the fractions alone
    assert [c.speeds.speed(0, k) for k in ("compute", "bandwidth", "link")] == [0.25, 0.5, 1.0]
    assert [c.speeds.speed(1, k) for k in ("compute", "bandwidth", "link")] == [0.5, 0.2, 0.4]
    assert c.speeds.type_speed("fl", "bandwidth") == 0.2 and c.speeds.type_speed("fl") == 0.5  # compute by default
    assert c.speeds.speed(2, "bandwidth") == 0.5  # plain CPU processes: 2 cores for 4
    half = two_type_cluster(host_cores=0.5)  # now each rank gets a quarter of a core, half of what it wants
    assert [half.speeds.speed(0, k) for k in ("compute", "bandwidth")] == [0.125, 0.25]
    assert two_type_cluster(host_cores=None).speeds.speed(1, "bandwidth") == 0.2  # no core share without host_cores
    with pytest.raises(EmulationError, match="unknown kind"):
        c.speeds.speed(0, "flops")


def test_an_emulated_replica_and_stage_cost_the_machines_divided_by_the_fractions():
    c, model, wl = two_type_cluster(None), specs.load_model_spec(ROOT / "exp/tiny-model"), specs.Workload(max_batch=8)
    eff = specs.Efficiency(per_type={"*": specs.TypeEfficiency(decode_overhead_s=0.002, train_overhead_s=0.05)})
    gpu = c.gpu("fl")
    native = cost_model.replica_cost(model, gpu, 1, 1, wl, eff, 2.0)
    emulated = cost_model.replica_cost(
        model, gpu, 1, 1, wl, eff, 2.0, 64 * 2**20, c.speeds.type_speed("fl", "bandwidth"), 0.5
    )
    assert emulated.round_s == pytest.approx(native.round_s / 0.2)  # decode, its per-step overhead included
    assert emulated.prefill_tflops == pytest.approx(native.prefill_tflops * 0.5)
    stage = lambda speed: cost_model.StageSpec("fl", model.layers, (1,), 2.0, 2.0, 0.0, speed)  # noqa: E731
    t_native = cost_model.train_step_seconds(model, [stage(1.0)], 1, 1, c.gpu_types, wl, eff)
    t_emulated = cost_model.train_step_seconds(model, [stage(c.speeds.speed(1, "compute"))], 1, 1, c.gpu_types, wl, eff)
    assert t_emulated == pytest.approx(t_native / 0.5)


def test_a_machine_profile_applies_to_every_emulated_type_and_a_type_profile_to_itself():
    c = two_type_cluster(None)
    machine = profile_fit.DeviceProfile("host", specs.TypeEfficiency(0.4, 0.6, 0.7, 0.002), 0.04, 0.01, 0.2, 0.001)
    eff = profile_fit.apply_profile(specs.Efficiency(), specs.Cluster(c.name, {k: v for k, v in c.gpu_types.items() if k != "cpu"},
                                                        c.machines[:2], c.inter_gbps, speeds=c.subset({2: 0}).speeds),
                                     machine, "m.yaml")  # fmt: skip
    for t in ("bw", "fl"):  # the type's nominal is half the profile's: the fractions double, the rates stay measured
        assert eff.of(t).mfu_train == pytest.approx(0.8) and eff.of(t).hbm_eff == pytest.approx(1.4)
    assert eff.link_eff == pytest.approx(0.1) and eff.sync_latency_s == 0.001
    own = profile_fit.DeviceProfile("fl", specs.TypeEfficiency(0.3, 0.5, 0.6, 0.001), 0.02, 0.005)
    eff2 = profile_fit.apply_profile(eff, c, own, "fl.yaml")
    assert eff2.of("fl").mfu_train == pytest.approx(0.3) and eff2.of("bw").mfu_train == pytest.approx(0.8)
    # a type's own profile measured under its throttle: its generator constants replace the machine's, its training
    # (unthrottled, another reading of the machine) does not -- one training measurement for every type
    machine_tp = profile_fit.DeviceProfile(
        "host", specs.TypeEfficiency(0.4, 0.6, 0.7, 0.002, 0.01, tp_unsplit=40.0), 0.04, 0.01
    )
    eff3 = profile_fit.apply_profile(specs.Efficiency(), c, machine_tp, "m.yaml")
    typed = profile_fit.DeviceProfile("fl", specs.TypeEfficiency(0.3, 0.5, 0.35, 0.004, 0.03, tp_unsplit=9.0), 0.02, 0.005,
                             emulated=True)  # fmt: skip
    te = profile_fit.apply_profile(eff3, c, typed, "fl.yaml").of("fl")
    assert (te.mfu_infer, te.hbm_eff, te.decode_overhead_s) == (0.5, 0.35, 0.004)
    assert te.mfu_train == eff3.of("fl").mfu_train and te.train_overhead_s == 0.01
    assert te.tp_unsplit / te.hbm_eff == pytest.approx(40.0 / eff3.of("fl").hbm_eff)  # the same seconds
    alone = profile_fit.apply_profile(specs.Efficiency(), c, typed, "fl.yaml").of("fl")
    assert alone.mfu_train == 0.3 and alone.tp_unsplit == 9.0  # no machine profile before it: its own
    plain = specs.load_cluster(ROOT / "exp/clusters/cpu.yaml")
    with pytest.raises(specs.SpecError, match="not a GPU type of cluster"):
        profile_fit.apply_profile(specs.Efficiency(), plain, machine, "m.yaml")


def hetero_experiment():
    """exp/hetero_cpu.py, its cluster spec, the tiny model and the CPU demo's workload at 8 rows a replica."""
    sys.path.insert(0, str(ROOT / "exp"))
    import hetero_cpu
    import yaml

    spec = yaml.safe_load((ROOT / "exp/clusters/cpu_hetero.yaml").read_text())
    model = specs.load_model_spec(ROOT / "exp/tiny-model")
    wl = specs.Workload(prompts_per_step=16, samples_per_prompt=8, prompt_len=29, gen_samples=[25.0], eta=4,
                     precision="fp32", microbatch_tokens=1024, max_batch=8, train_passes=3)  # fmt: skip
    return hetero_cpu, spec, model, wl


def test_the_hetero_experiment_plans_five_splits_of_one_budget():
    hetero_cpu, spec, model, wl = hetero_experiment()
    plans = hetero_cpu.make_plans(spec, model, wl, [str(ROOT / "exp/profiles/cpu.yaml")], 64.0)
    assert list(plans) == ["planner", "swapped", "mixed", "all-h20ish", "all-h800ish"]

    def trainers(pj: dict) -> list[int]:
        counts = [0, 0]
        for r in pj["ranks"]:
            counts[r["machine"]] += r["role"] == "train"
        return counts

    planner = trainers(plans["planner"][0])
    assert trainers(plans["swapped"][0]) == [2 - k for k in planner]
    assert trainers(plans["mixed"][0]) == [1, 1]
    dollars = {name: pj["predicted"]["dollars_per_hour"] for name, (pj, _) in plans.items()}
    assert len(set(dollars.values())) == 1  # one budget
    for t in ("h20ish", "h800ish"):
        pj, sub = plans[f"all-{t}"]
        assert {r["gpu_type"] for r in pj["ranks"]} == {t} and len(pj["ranks"]) == 4
        assert sub["gpu_types"][t]["emulate"] == spec["gpu_types"][t]["emulate"]
    # the planner's plan is the best of the five under the cost model that made it
    steps = {name: pj["predicted"]["step_s"] for name, (pj, _) in plans.items()}
    assert min(steps, key=steps.get) == "planner"
    # re-pricing a plan on its own workload gives back its prediction
    pj, sub = plans["mixed"]
    again = hetero_cpu.predict(pj, sub, model, wl, [str(ROOT / "exp/profiles/cpu.yaml")], 64.0)
    assert again.step_s == pytest.approx(pj["predicted"]["step_s"])


def test_the_hetero_summary_splits_a_replicas_generation_into_work_padding_and_waits():
    hetero_cpu, spec, model, wl = hetero_experiment()
    profile = [str(ROOT / "exp/profiles/cpu.yaml")]
    pj, sub = hetero_cpu.make_plans(spec, model, wl, profile, 64.0)["planner"]
    ev = hetero_cpu.predict(pj, sub, model, wl, profile, 64.0)
    replicas = len(pj["rollout"]["replicas"])

    def row(step: int, wall: float, cpu: float, pad: float, steps: int) -> dict:
        return {"step": step, "rollout_generate_s": wall, "rollout_generate_cpu_s": cpu, "rollout_throttle_s": pad,
                "rollout_generate_steps": steps}  # fmt: skip

    # two runs; counters are cumulative sums over the replicas, so each run's growth per step is divided by both
    runs = [[row(4, 10, 4, 3, 100), row(8, 10 + 4 * 6, 4 + 4 * 2, 3 + 4 * 3, 100 + 4 * 80)],
            [row(4, 0, 0, 0, 0), row(6, 2 * 8, 2 * 2, 2 * 4, 2 * 120)]]  # fmt: skip
    g = hetero_cpu.generation(runs, replicas, ev, sub)
    assert g["wall_s"] == pytest.approx((6 + 8) / 2 / replicas)
    assert g["cpu_s"] == pytest.approx((2 + 2) / 2 / replicas)
    assert g["throttle_s"] == pytest.approx((3 + 4) / 2 / replicas)
    assert g["wait_s"] == pytest.approx(g["wall_s"] - g["cpu_s"] - g["throttle_s"])
    assert g["cpu_per_step_s"] == pytest.approx(g["cpu_s"] / ((80 + 120) / 2 / replicas))
    # the priced CPU of a step is the priced round at the type's bandwidth fraction (no core contention here)
    bandwidth = spec["gpu_types"][pj["rollout"]["replicas"][0]["gpu_type"]]["emulate"]["bandwidth"]
    assert g["priced_wall_per_step_s"] == pytest.approx(pj["rollout"]["replicas"][0]["round_s"], rel=1e-6)
    assert g["priced_cpu_per_step_s"] == pytest.approx(g["priced_wall_per_step_s"] * bandwidth, rel=1e-6)
    # a decode contention is wall time beyond the CPU work: it leaves the priced CPU of the same round less
    ev.host_pricing["decode_contention"] = {cfg.gpu_type: 1.25 for cfg, _ in ev.rollout.replicas}
    contended = hetero_cpu.generation(runs, replicas, ev, sub)
    assert contended["priced_cpu_per_step_s"] == pytest.approx(g["priced_cpu_per_step_s"] / 1.25, rel=1e-6)
    assert hetero_cpu.generation([[row(4, 1, 1, 0, 1)]], replicas, ev, sub) == {}  # one steady step: no growth
    assert hetero_cpu.generation([[{"step": 4}, {"step": 5}]], replicas, ev, sub) == {}  # runs before the counters


def test_an_emulated_ranks_core_share_is_whole_in_every_role_of_every_split():
    """cpu_hetero gives each machine one core for two ranks that want at most half a core each: whatever a split
    puts on a machine, and whichever role a rank has there, the planner prices it at its type's fractions alone
    (a core share of 1), so the emulation, not the sharing, sets the types' speeds."""
    hetero_cpu, spec, model, wl = hetero_experiment()
    p = hetero_cpu.planner_for(spec, model, wl, [str(ROOT / "exp/profiles/cpu.yaml")], 64.0)
    checked = 0
    for counts in ((0, 2), (2, 0), (1, 1), (2, 1), (1, 2)):
        ev = p.evaluate(counts)
        if not ev.train or not ev.rollout:
            continue
        priced = p.cluster.speeds.with_busy_devices(ev.host_pricing["busy_devices"])
        for m, roles in ev.host_pricing["busy_devices"].items():
            emulate = p.cluster.speeds.emulated[p.cluster.machines[m].gpu_type]
            for role in roles:
                for kind in ("compute", "bandwidth", "link"):
                    assert priced.speed(m, kind, role) == emulate.fraction(kind), (counts, m, role, kind)
                    checked += 1
    assert checked >= 3 * 2 * 3  # three splits or more, each with both roles


def test_a_rollout_rank_is_priced_at_the_decode_contention_of_its_splits_trainers():
    """TypeEfficiency.decode_beside (a type profile's decode step beside each type's trainers): the planner prices
    each type's replicas at the mean factor over the split's train GPUs by type, a trainer type not measured counting
    as the replica's own; the rounds stretch by exactly it, and the plan JSON carries it to a replay."""
    sys.path.insert(0, str(ROOT / "exp"))
    from planner import simulate

    hetero_cpu, spec, model, wl = hetero_experiment()
    base = hetero_cpu.planner_for(spec, model, wl, [str(ROOT / "exp/profiles/cpu.yaml")], 64.0)
    eff = specs.Efficiency.from_dict(base.eff.to_dict())
    eff.per_type["h20ish"].decode_beside = {"h20ish": 1.1, "h800ish": 1.3}
    eff.per_type["h800ish"].decode_beside = {"h800ish": 1.05}  # its profile never saw h20ish trainers
    assert host.decode_contention(eff, {"h20ish": 1, "h800ish": 3}) == pytest.approx(
        {"h20ish": (1.1 + 3 * 1.3) / 4, "h800ish": 1.05}
    )
    assert host.decode_contention(base.eff, {"h20ish": 2}) == {}  # no type measured beside neighbours
    assert host.decode_contention(eff, {}) == {}  # no trainers
    contended = search.Planner(base.cluster, model, wl, eff, weight_bucket_mb=64.0)
    machines = [m.gpu_type for m in base.cluster.machines]
    for counts, expect in (
        (tuple(2 * (t == "h800ish") for t in machines), {"h20ish": 1.3, "h800ish": 1.05}),  # trainers all h800ish
        ((1, 1), {"h20ish": 1.2, "h800ish": 1.05}),
        (tuple(2 * (t == "h20ish") for t in machines), {"h20ish": 1.1, "h800ish": 1.05}),
    ):
        plain, ev = base.evaluate(counts), contended.evaluate(counts)
        assert (
            ev.host_pricing["decode_contention"] == pytest.approx(expect)
            and "decode_contention" not in plain.host_pricing
        )
        for (cfg, ids), (cfg0, ids0) in zip(ev.rollout.replicas, plain.rollout.replicas):
            assert cfg.gpu_type == cfg0.gpu_type and ids == ids0
            # a core share of 1 on this cluster (two ranks of at most half a core each per machine's one core)
            assert cfg.cost.round_s == pytest.approx(cfg0.cost.round_s * expect[cfg.gpu_type], rel=1e-9)
        assert ev.rollout_s > plain.rollout_s
    pj = schedule.plan(base.cluster, model, wl, eff, weight_bucket_mb=64.0)
    assert set(pj["predicted"]["decode_contention"]) == {"h20ish", "h800ish"}
    again, counts = schedule.planner_from_plan(pj)
    assert again.evaluate(counts).step_s == pytest.approx(pj["predicted"]["step_s"])
    cluster, model2, wl2, eff2 = simulate._inputs(pj, None, None)
    replicas = simulate.build_replicas(pj, cluster, model2, wl2, eff2)
    for rep, priced in zip(replicas, pj["rollout"]["replicas"]):
        assert rep.round_s[rep.batch] == pytest.approx(
            priced["round_s"], rel=1e-6
        )  # the replay's rounds are the plan's


def test_decode_beside_is_the_measured_wall_over_the_fits_price_and_checked():
    """profile_fit.decode_beside_fit: each neighbour type's measured wall per step over what the profile's decode
    constants price that step's CPU work at, at the type's fraction; check_profile_efficiency bounds it."""
    spec = specs.load_model_spec(ROOT / "exp/tiny-model")
    gpu = specs.GPUType("h20ish", 2, 0.035, 0.013, 1.0, 2.0)
    te = specs.TypeEfficiency(hbm_eff=0.75, mfu_decode=0.65, decode_combine="sum", decode_overhead_s=0.0035)
    cpu_s = cost_model.decode_round_s(spec, gpu, te, 1, 1, 8, 72.5, 4, 2.0)
    assert 0.005 < cpu_s < 0.05  # a CPU core's step of the tiny model, 8 rows
    points = {"h20ish": {"wall_s": 2.2 * cpu_s, "cpu_s": cpu_s}, "h800ish": {"wall_s": 2.6 * cpu_s, "cpu_s": cpu_s}}
    measured = {"model_config": spec.to_config(), "batch": 8, "context": 72.5, "bytes": 4, "fraction": 0.5,
                "points": points}  # fmt: skip
    fit = profile_fit.decode_beside_fit(measured, gpu, te)
    assert fit == pytest.approx({"h20ish": 1.1, "h800ish": 1.3})  # wall / (priced CPU / 0.5)
    assert (
        profile_fit.decode_beside_fit(None, gpu, te) == {}
        and profile_fit.decode_beside_fit({"points": {}}, gpu, te) == {}
    )
    good = {"mfu_train": 0.3, "mfu_infer": 0.3, "hbm_eff": 0.3, "decode_overhead_s": 0.001, "train_overhead_s": 0.01}
    te = profile_fit.check_profile_efficiency({**good, "decode_beside": fit}, "p.yaml")
    assert te.decode_beside == pytest.approx(fit)
    for bad, what in ((9.0, "not physically plausible"), (0.3, "not physically plausible"), ("x", "must be a number")):
        with pytest.raises(specs.SpecError, match=f"p.yaml: efficiency.decode_beside.h800ish.*{what}"):
            profile_fit.check_profile_efficiency({**good, "decode_beside": {"h800ish": bad}}, "p.yaml")
    with pytest.raises(specs.SpecError, match="must map neighbour GPU types to numbers"):
        profile_fit.check_profile_efficiency({**good, "decode_beside": [1.0]}, "p.yaml")
    # a type profile's factors reach its type when applied
    cluster = specs.load_cluster(ROOT / "exp/clusters/cpu_hetero.yaml")
    prof = profile_fit.DeviceProfile("h20ish", te, 0.03, 0.012, emulated=True)
    assert profile_fit.apply_profile(specs.Efficiency(), cluster, prof, "p.yaml").of(
        "h20ish"
    ).decode_beside == pytest.approx(fit)


def test_the_cotenancy_bench_mixes_follow_the_clusters_ranks():
    """exp/bench_cotenancy.py's default mixes: the profile's co-load as exp/hetero_cpu.sh sets it (ranks less one
    peers, half the ranks training in DP pairs) and the same decoders beside each other type's trainers."""
    sys.path.insert(0, str(ROOT / "exp"))
    import bench_cotenancy
    import yaml

    spec = yaml.safe_load((ROOT / "exp/clusters/cpu_hetero.yaml").read_text())
    assert bench_cotenancy.default_mixes(spec, "h20ish") == {
        "alone": "",
        "profile": "D:h20ish,DP:h20ish",
        "D+DP:h800ish": "D:h20ish,DP:h800ish",
    }
    spec["machines"][0]["gpus"] = 4  # six ranks: five peers, three of them training
    mixes = bench_cotenancy.default_mixes(spec, "h800ish")
    assert mixes["profile"] == "D:h800ish,D:h800ish,DP:h800ish,T:h800ish"
    assert mixes["D+DP:h20ish"] == "D:h800ish,D:h800ish,DP:h20ish,T:h20ish"
    for peers in mixes.values():  # every default mix is one the bench parses
        bench_cotenancy.parse_mix(peers, spec["gpu_types"])
