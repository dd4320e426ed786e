"""End to end on CPU: torchrun train.py with a tiny random model. The ledger audits staleness and exactly-once
consumption; the train ranks send the planner's bytes; dynamic sampling drops flat groups exactly once; colocated
mode shares one device; an emulated device type is padded and says so; with TP and PP plans the step-1 loss and
grad norm are those of the DP run (the trajectories do not depend on the layout: per-request seeds)."""

import json
import subprocess
import sys

import pytest
from test_emulation import emulated_cluster
from tiny import ENV, ROOT, torchrun

REQUIRED = [
    "step",
    "version",
    "reward_mean",
    "train_accuracy",
    "trained_tokens_per_s",
    "generated_tokens_per_s",
    "staleness_max",
    "staleness_mean",
    "rollout_idle_frac",
    "trainer_idle_frac",
    "weight_sync_s",
    "weight_ready_s",
    "step_s",
    "loss",
    "grad_norm",
    "pg_clipfrac",
    "importance_weight_mean",
    "importance_weight_max",
    "entropy",
    "train_peak_memory_bytes",
    "rollout_peak_memory_bytes",
]


def run_train(tmp_path, tiny_model_dir, eta, steps=4, extra=(), nproc=4):
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.run_dir={tmp_path}",
        "logging.run_name=r",
        f"train.total_steps={steps}",
        "train.max_train_seconds=0",
        "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=24",
        "data.num_test=4",
        "data.num_train=200",
        "logging.eval_every=2",
        "logging.progress=false",
        f"max_staleness={eta}",
        *extra,
    ]
    proc = torchrun(nproc, args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "r"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    ledger = [json.loads(line) for line in open(run / "ledger.jsonl")]
    return metrics, ledger


def check_ledger(ledger, eta, steps, batch):
    keys = [(e["group_id"], e["sample_idx"]) for e in ledger]
    assert len(keys) == len(set(keys)) == steps * batch, "a trajectory was lost or trained twice"
    for e in ledger:
        assert e["trainer_version"] == e["step"] - 1
        assert e["trainer_version"] - e["min_version"] <= eta, e  # every token, not only the first
        assert e["min_version"] <= e["max_version"] <= e["trainer_version"]
    assert [e["step"] for e in ledger] == sorted(e["step"] for e in ledger)  # versions are monotonic


# Each run below is audited by several tests: a launch of four ranks costs about half a minute of CPU before its
# first step, so a property that does not need a run of its own reads one that another property needs anyway.


def cpu_plan(tmp_path, tiny_model_dir):
    """schedule.py's plan for the CPU cluster: two train ranks in DP, two rollout replicas, 0.02 MB buckets."""
    plan = tmp_path / "plan.json"
    cmd = [sys.executable, "schedule.py", "--cluster", "exp/clusters/cpu.yaml", "--model", str(tiny_model_dir)]
    cmd += ["--nproc", "4", "--train-layout", "2,1,1", "--precision", "fp32", "--weight-bucket-mb", "0.02"]
    subprocess.run([*cmd, "--out", str(plan), "--quiet"], cwd=ROOT, env=ENV, check=True, timeout=120)
    return plan


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, tiny_model_dir):
    """max_staleness=0, 4 steps, the default plan (2 train ranks in DP, 2 rollout ranks)."""
    return run_train(tmp_path_factory.mktemp("sync"), tiny_model_dir, 0, 4)


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory, tiny_model_dir):
    """max_staleness=2, 4 steps, on cpu_plan (the default plan's layout, as the planner writes it)."""
    tmp_path = tmp_path_factory.mktemp("planned")
    plan = cpu_plan(tmp_path, tiny_model_dir)
    metrics, ledger = run_train(tmp_path, tiny_model_dir, 2, 4, [f"plan.path={plan}", "dist.weight_bucket_mb=0.02"])
    return plan, metrics, ledger


@pytest.fixture(scope="module")
def emulated_run(tmp_path_factory, tiny_model_dir):
    """max_staleness=1, 3 steps on an emulated device type (compute and bandwidth at half speed), with DAPO's dynamic
    sampling (at most 2 flat groups dropped per step) and soft overlong penalty."""
    import yaml

    tmp_path = tmp_path_factory.mktemp("emulated")
    cluster = tmp_path / "emulated.yaml"
    cluster.write_text(yaml.safe_dump(emulated_cluster({"compute": 0.5, "bandwidth": 0.5})))
    plan = tmp_path / "plan.json"
    cmd = [sys.executable, "schedule.py", "--cluster", str(cluster), "--model", str(tiny_model_dir)]
    subprocess.run([*cmd, "--train-layout", "2,1,1", "--out", str(plan), "--quiet"], cwd=ROOT, env=ENV, check=True)
    extra = ["train.dynamic_sampling_max_discards=2", "train.overlong=penalty", "train.overlong_buffer_tokens=8"]
    return run_train(tmp_path, tiny_model_dir, 1, 3, [*extra, f"plan.path={plan}", "dist.timeout_s=120"])


@pytest.mark.parametrize("eta", [0, 2])
def test_train_runs_and_respects_staleness(request, eta):
    """eta 0 reads sync_run, eta 2 planned_run."""
    steps = 4
    run = request.getfixturevalue("sync_run" if eta == 0 else "planned_run")
    metrics, ledger = run if eta == 0 else run[1:]
    step_lines = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in step_lines] == list(range(1, steps + 1))
    for m in step_lines:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, missing
        assert m["staleness_max"] <= eta
        assert m["train_peak_memory_bytes"] > 0 and m["rollout_peak_memory_bytes"] > 0, m
    evals = [m for m in metrics if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2, 4] and all(m["eval_n"] == 4 for m in evals)
    check_ledger(ledger, eta, steps, batch=2 * 4)
    if eta == 0:  # synchronous: every token of a batch trained at v was produced by version v
        assert all(e["min_version"] == e["max_version"] == e["trainer_version"] for e in ledger)


def test_train_ranks_send_the_planned_bytes_every_step(planned_run):
    """A plan from schedule.py with two rollout replicas: every step's weight_sync_bytes (what the train ranks
    sent) equals the plan's predicted sync_bytes, and so does weight_sync_predicted_bytes."""
    plan, metrics, _ = planned_run
    predicted = json.loads(plan.read_text())["predicted"]["sync_bytes"]
    replicas = json.loads(plan.read_text())["rollout"]["replicas"]
    assert len(replicas) == 2
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 4
    for m in steps:
        assert m["weight_sync_bytes"] == m["weight_sync_predicted_bytes"] == predicted, m
        assert m["weight_sync_dtype"] == "float32"


def test_dynamic_sampling_and_overlong_penalty_end_to_end(emulated_run):
    """A real run with DAPO's dynamic sampling and soft overlong penalty: flat groups (the tiny random model fails
    nearly everything) are dropped up to the limit per step and replaced; the ledger holds every group exactly once,
    trained or dropped, and the steps still train full batches within the staleness bound."""
    metrics, ledger = emulated_run
    trained = [e for e in ledger if "dropped" not in e]
    dropped = [e for e in ledger if "dropped" in e]
    check_ledger(trained, 1, 3, batch=2 * 4)
    groups = {}
    for e in ledger:
        groups.setdefault(e["group_id"], set()).add("dropped" in e)
    assert all(len(v) == 1 for v in groups.values()), "a group both trained and dropped"
    steps = [m for m in metrics if "loss" in m]
    n_dropped = len({e["group_id"] for e in dropped})
    assert n_dropped == sum(m["dropped_groups"] for m in steps)  # each drop counted in the next step's line
    assert all(m["dropped_groups"] <= 2 for m in steps) and n_dropped > 0
    assert all(e["trainer_version"] is None and not e["updated"] for e in dropped)


def test_an_emulated_run_says_so_in_every_step_line(emulated_run):
    metrics, _ = emulated_run
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 3 and all(m["emulated"] == ["slow"] for m in steps)
    assert steps[-1]["rollout_throttle_s"] > 0
    # the generator steps' wall time holds their padding and fits in the rollout ranks' time (2 ranks)
    assert steps[-1]["rollout_throttle_s"] < steps[-1]["rollout_generate_s"] < 2 * steps[-1]["elapsed_s"]
    # their CPU seconds are the rest of it, less the waits for a core: work and padding fit in the wall time
    last = steps[-1]
    assert 0 < last["rollout_generate_cpu_s"] < last["rollout_generate_s"] - last["rollout_throttle_s"] + 1e-3
    assert last["rollout_generate_steps"] >= steps[0]["rollout_generate_steps"] > 0  # the latest reports


def test_colocated_mode_shares_one_device_and_trains_exactly_once(tmp_path, tiny_model_dir):
    """dist.colocate on CPU: 1 rollout + 1 train rank, every group on gloo, weights handed over in shared memory
    (dist.handover=auto), the buckets a relay forwards staged through host memory (forced here: on CPU they need
    not be), the staleness bound and exactly-once hold."""
    from parallel.weight_sync import STAGE_ENV

    args = [
        f"model.path={tiny_model_dir}",
        f"logging.run_dir={tmp_path}",
        "logging.run_name=r",
        "train.total_steps=3",
        "train.max_train_seconds=0",
        "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "data.num_test=4",
        "data.num_train=100",
        "logging.eval_every=3",
        "logging.progress=false",
        "max_staleness=1",
        "plan.num_rollout=1",
        "dist.colocate=true",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "train.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, STAGE_ENV: "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "r"
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["weight_sync_bytes"] == m["weight_sync_predicted_bytes"] > 0 for m in steps), steps
    assert all(m["weight_sync_handover"] == "shared" for m in steps), steps
    check_ledger([json.loads(line) for line in open(run / "ledger.jsonl")], 1, 3, batch=2 * 4)


def test_step1_loss_and_grad_norm_match_across_layouts(tmp_path, tiny_model_dir, sync_run):
    """max_staleness=0, one step on a TP-2 and on a PP-2 plan (one rollout rank each): the step-1 loss, grad norm,
    tokens and reward are those of sync_run (2 train ranks in DP, 2 rollout ranks, the same config)."""
    from plan import make_train_plan, stage_layer_ranges

    ref = [x for x in sync_run[0] if "loss" in x][0]
    for dp, tp, pp in [(1, 2, 1), (1, 1, 2)]:
        world = dp * tp * pp + 1
        plan = make_train_plan(dp, tp, pp, [tuple(x) for x in stage_layer_ranges(2, pp)], world_size=world)
        run_dir = tmp_path / f"l{dp}{tp}{pp}"
        run_dir.mkdir()
        (run_dir / "plan.json").write_text(json.dumps(plan))
        metrics, _ = run_train(run_dir, tiny_model_dir, 0, 1, [f"plan={run_dir / 'plan.json'}"], nproc=world)
        m = [x for x in metrics if "loss" in x][0]
        for key in ("loss", "grad_norm", "trained_tokens", "reward_mean"):
            assert m[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), ((dp, tp, pp), key, m[key], ref[key])
