"""Simulator tests: eta behaviour, staleness, agreement with the planner, and the measured-profile hook."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "exp"))

import schedule  # noqa: E402
from planner import simulate, specs  # noqa: E402


def _plan(max_batch: int) -> dict:
    cluster = specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 4)
    model = specs.model_from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
        "tiny",
    )
    wl = specs.Workload(
        prompts_per_step=16,
        samples_per_prompt=4,
        prompt_len=32,
        gen_samples=[32, 100, 300, 900],
        eta=2,
        max_batch=max_batch,
        microbatch_tokens=2048,
    )
    return schedule.plan(cluster, model, wl, specs.Efficiency(sync_latency_s=0.05))


@pytest.fixture(scope="module")
def plan() -> dict:
    return _plan(max_batch=8)


def test_async_beats_sync_and_staleness_respects_eta():
    plan = _plan(max_batch=2)  # a rollout slow enough that overlapping it with training is worth something
    sync = simulate.simulate(plan, steps=10, eta=0)
    asyn = simulate.simulate(plan, steps=10, eta=2)
    assert sync["staleness"]["max"] == 0
    assert asyn["staleness"]["mean"] > 0
    assert asyn["tokens_per_s"] > 1.1 * sync["tokens_per_s"]
    assert sync["trainer_idle_frac"] > asyn["trainer_idle_frac"]
    for r in (sync, asyn):
        assert 0 <= r["rollout_idle_frac"] <= 1 and 0 <= r["trainer_idle_frac"] <= 1


def test_eta_sweep_grows_then_saturates(plan):
    tput = [simulate.simulate(plan, steps=10, eta=e)["tokens_per_s"] for e in (0, 1, 4, 8)]
    assert tput[1] > tput[0]
    assert tput[3] == pytest.approx(tput[2], rel=0.15)  # saturated: more staleness buys little


def test_deterministic_for_a_seed(plan):
    assert simulate.simulate(plan, steps=6, seed=3) == simulate.simulate(plan, steps=6, seed=3)


def test_simulated_step_is_near_the_planner_prediction(plan):
    res = simulate.simulate(plan, steps=12, eta=2)
    assert res["step_s"] == pytest.approx(plan["predicted"]["step_s"], rel=0.35)


def test_predict_from_measured_profile(plan):
    tokens = plan["inputs"]["workload"]
    mean_tokens = tokens["prompt_len"] + sum(tokens["gen_samples"]) / len(tokens["gen_samples"])
    batch_tokens = tokens["prompts_per_step"] * tokens["samples_per_prompt"] * mean_tokens
    # trainer-bound run: step ~= one batch of tokens at the measured train speed + sync
    slow_train = simulate.predict_from_measured(plan, decode_s_per_token=1e-5, train_s_per_token=1e-3, sync_s=0.5)
    assert slow_train["step_s"] == pytest.approx(batch_tokens * 1e-3 + 0.5, rel=0.1)
    # rollout-bound run: doubling the measured decode time roughly doubles the step
    a = simulate.predict_from_measured(plan, decode_s_per_token=2e-3, train_s_per_token=1e-7, sync_s=0.0)
    b = simulate.predict_from_measured(plan, decode_s_per_token=4e-3, train_s_per_token=1e-7, sync_s=0.0)
    assert b["step_s"] / a["step_s"] == pytest.approx(2.0, rel=0.1)
    assert a["tokens_per_s"] > b["tokens_per_s"]


def test_bad_inputs(plan):
    with pytest.raises(ValueError, match="warmup"):
        simulate.simulate(plan, steps=2)
    empty = {**plan, "rollout": {"replicas": [], "tokens_per_s": 0}}
    with pytest.raises(ValueError, match="no rollout replicas"):
        simulate.simulate(empty, steps=5)


def test_long_tail_workload_keeps_the_mean_and_rejects_bad_sigma(plan):
    wl = simulate.long_tail_workload(plan, 1.5)
    base = specs.Workload(**plan["inputs"]["workload"])
    assert max(wl.gen_samples) > 5 * min(wl.gen_samples)
    assert wl.gen_mean == pytest.approx(base.gen_mean, rel=0.05)  # the 20x-mean cap trims a little
    with pytest.raises(ValueError, match="sigma"):
        simulate.long_tail_workload(plan, 0.0)


@pytest.mark.parametrize("eta", [1, 2])
def test_simulator_runs_the_buffers_rule(plan, eta):
    """Under long tails the buffer's own rules keep the bound; plain AReaL (completion order) does not."""
    # sigma 2: the plan's two replicas outrun its trainer, so a milder tail rarely leaves a sequence eta behind
    wl = simulate.long_tail_workload(plan, 2.0)
    worst = {
        order: max(
            simulate.simulate(plan, wl, steps=12, eta=eta, seed=s, consume_order=order)["staleness"]["max"]
            for s in range(3)
        )
        for order in ("deadline", "admission", "completion")
    }
    assert worst["deadline"] <= eta and worst["admission"] <= eta
    assert worst["completion"] > eta


def test_a_cpu_plans_replicas_run_at_the_core_share_it_was_priced_at():
    """CPU processes sharing cores: the simulator's replicas decode at the plan's own round times (the core share
    of the devices busy at once that Planner.evaluate priced), not at every device busy."""
    cluster = specs.load_cluster(ROOT / "exp/clusters/cpu.yaml", 4)
    wl = specs.Workload(prompts_per_step=16, samples_per_prompt=8, prompt_len=29.0, gen_samples=[25.5], eta=4,
                     precision="fp32", max_batch=64)  # fmt: skip
    pj = schedule.plan(cluster, specs.load_model_spec(ROOT / "exp/tiny-model"), wl, specs.Efficiency())
    busy = pj["predicted"]["busy_devices"]["0"]
    assert busy["train"] < 4  # the replicas wait part of the step, so the trainers get more than 2 / 4 of a core
    c, model, w, eff = simulate._inputs(pj, None, None)
    for role, b in busy.items():
        assert c.speeds.speed(0, "bandwidth", role) == pytest.approx(min(1.0, 2 / b)), role
    assert c.speeds.speed(0, "compute", "train") > 0.5
    replicas = simulate.build_replicas(pj, c, model, w, eff)
    for rep, planned in zip(replicas, pj["rollout"]["replicas"]):
        assert rep.round_s[rep.batch] == pytest.approx(planned["round_s"], rel=1e-9)


def test_the_trainer_pauses_for_its_sends_and_the_replicas_until_they_hold_the_version(plan):
    """A sync the replicas take 2 s longer to finish than the trainer's sends: a train-bound step (eta 8, a slow
    trainer) grows by nothing, an eta = 0 step, which waits for the replicas, by the 2 s."""
    mean_tokens = plan["inputs"]["workload"]["prompt_len"] + 333.0
    slow_train = 20.0 / (64 * mean_tokens)  # 20 s a step: the rollout finishes well within it

    def step(eta: int, ready_s: float) -> float:
        kw = {"train_s_per_token": slow_train, "sync_s": ready_s, "sync_send_s": 0.5}
        return simulate.simulate(plan, steps=8, eta=eta, **kw)["step_s"]

    assert step(8, 2.5) == pytest.approx(step(8, 0.5), rel=1e-3)
    assert step(0, 2.5) - step(0, 0.5) == pytest.approx(2.0, rel=0.05)
