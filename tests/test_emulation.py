"""Emulated device types (emulation.py): the throttle's arithmetic, its validation, the plan plumbing, the
generator-step split, and an emulated run end to end."""

import json
import statistics
import subprocess
import sys
import time
import types

import pytest
from tiny import ENV, ROOT, torchrun

import cost_model as cm
from emulation import Emulation, EmulationError, Throttle, emulated_types


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("kind, fraction", [("compute", 0.5), ("bandwidth", 0.25), ("link", 0.8)])
def test_a_piece_measured_at_t_takes_t_over_the_fraction(kind, fraction):
    throttle = Throttle(Emulation(**{kind: fraction}))
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        with throttle.piece(kind):
            busy(0.04)
        took.append(time.perf_counter() - t0)
    assert statistics.median(took) == pytest.approx(0.04 / fraction, rel=0.10)
    other = next(k for k in ("compute", "bandwidth", "link") if k != kind)
    assert throttle.pad(other, 0.04) == 0.0  # other kinds run at full speed


@pytest.mark.parametrize("kind", ["compute", "bandwidth"])
def test_a_work_piece_costs_its_cpu_time_so_sharing_a_core_does_not_slow_it_further(kind):
    """Half of the piece the thread is off the CPU (as when another rank holds the core): the piece still takes
    its CPU time / fraction, not its stretched wall time / fraction."""
    throttle = Throttle(Emulation(**{kind: 0.25}))
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        with throttle.piece(kind):
            busy(0.02)
            time.sleep(0.02)
        took.append(time.perf_counter() - t0)
    assert statistics.median(took) == pytest.approx(0.02 / 0.25, rel=0.15)


def test_a_link_piece_is_a_wait_and_costs_its_wall_time():
    throttle = Throttle(Emulation(link=0.5))
    t0 = time.perf_counter()
    with throttle.piece("link"):
        time.sleep(0.03)
    assert time.perf_counter() - t0 == pytest.approx(0.06, rel=0.15)


def test_a_contended_piece_past_its_fraction_is_not_padded():
    throttle = Throttle(Emulation(compute=0.5))
    assert throttle.pad("compute", 0.10, cpu_seconds=0.04) == 0.0  # 0.04 / 0.5 < 0.10 already: only ever slower
    assert throttle.pad("compute", 0.05, cpu_seconds=0.04) == pytest.approx(0.03)


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
    cluster = cm.cluster_from_dict(emulated_cluster({"compute": 0.5}))
    assert cluster.gpu_types["slow"].emulate == Emulation(compute=0.5)
    again = cm.cluster_from_dict(cluster.to_dict())  # plan JSON round trip
    assert again.gpu_types["slow"].emulate == Emulation(compute=0.5)
    plan = {"inputs": {"cluster": cluster.to_dict()}, "ranks": [{"rank": 0, "gpu_type": "slow"}]}
    assert Throttle.for_rank(plan, 0).emulation == Emulation(compute=0.5)
    assert not Throttle.for_rank({"ranks": [{"rank": 0}]}, 0).active  # no cluster in the plan: full speed
    assert emulated_types(plan) == ["slow"]
    plain = cm.load_cluster("exp/clusters/cpu.yaml")
    assert "emulate" not in json.dumps(plain.to_dict())  # shipped clusters unchanged


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
    worker.throttle = Throttle(Emulation(compute=0.5, bandwidth=0.25))
    assert worker.step(Gen()) == ["out"]
    assert worker.throttle.slept_s["compute"] == pytest.approx(0.02, rel=0.15)  # ~0.02 * (1/0.5 - 1)
    assert worker.throttle.slept_s["bandwidth"] == pytest.approx(0.09, rel=0.15)  # ~0.03 * (1/0.25 - 1)


def test_an_emulated_run_says_so_in_every_step_line(tmp_path, tiny_model_dir):
    import yaml

    cluster = tmp_path / "emulated.yaml"
    cluster.write_text(yaml.safe_dump(emulated_cluster({"compute": 0.5, "bandwidth": 0.5})))
    plan = tmp_path / "plan.json"
    cmd = [sys.executable, "schedule.py", "--cluster", str(cluster), "--model", str(tiny_model_dir)]
    subprocess.run([*cmd, "--train-layout", "2,1,1", "--out", str(plan), "--quiet"], cwd=ROOT, env=ENV, check=True)
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.run_dir={tmp_path}",
        "logging.run_name=r",
        "train.total_steps=2",
        "train.max_train_seconds=0",
        "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "data.num_test=4",
        "data.num_train=100",
        "logging.progress=false",
        f"plan.path={plan}",
        "dist.timeout_s=120",
    ]
    proc = torchrun(4, args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(steps) == 2 and all(m["emulated"] == ["slow"] for m in steps)
    assert steps[-1]["rollout_throttle_s"] > 0
