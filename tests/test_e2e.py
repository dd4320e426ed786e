"""End to end on CPU: torchrun train.py with a tiny random model; the ledger audits staleness and
exactly-once consumption; weights reach the rollout ranks bitwise."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import ENV, ROOT, run_sync_worker, torchrun

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


def run_train(tmp_path, tiny_model_dir, eta, steps=4, extra=()):
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.run_dir={tmp_path}",
        "logging.run_name=r",
        f"train.total_steps={steps}",
        "train.max_train_seconds=0",
        "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=24",
        "data.num_test=8",
        "data.num_train=200",
        "logging.eval_every=2",
        "logging.progress=false",
        f"max_staleness={eta}",
        *extra,
    ]
    proc = torchrun(4, args, timeout=300)
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


@pytest.mark.parametrize("eta", [0, 2])
def test_train_runs_and_respects_staleness(tmp_path, tiny_model_dir, eta):
    steps = 4
    metrics, ledger = run_train(tmp_path, tiny_model_dir, eta, steps)
    step_lines = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in step_lines] == list(range(1, steps + 1))
    for m in step_lines:
        missing = [k for k in REQUIRED if k not in m]
        assert not missing, missing
        assert m["staleness_max"] <= eta
        assert m["train_peak_memory_bytes"] > 0 and m["rollout_peak_memory_bytes"] > 0, m
    evals = [m for m in metrics if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2, 4] and all(m["eval_n"] == 8 for m in evals)
    check_ledger(ledger, eta, steps, batch=2 * 4)
    if eta == 0:  # synchronous: every token of a batch trained at v was produced by version v
        assert all(e["min_version"] == e["max_version"] == e["trainer_version"] for e in ledger)


@pytest.mark.parametrize(
    "layout, bucket_mb, machines, dtype",
    [
        ((1, 1, 1), 0.01, "0,0,1", "float32"),
        ((1, 2, 2), 64, "0,0,1", "bfloat16"),
        ((2, 1, 1), 0.02, "0,1,1", "bfloat16"),  # FSDP: each DP rank holds half the stage and both lend it
        ((1, 1, 1), 0.05, "0,0", "staged"),  # colocated mode's path: every bucket through host memory
        ((1, 1, 2), 0.02, "0,0", "shared"),  # dist.handover=shared: two owners' slots, the relay forwards on the wire
    ],
    ids=["dp1tp1pp1-small-buckets-fp32", "dp1tp2pp2-bf16", "dp2-fsdp-bf16", "staged-through-host-fp32", "shared-pp2"],
)
def test_weights_stream_bitwise_and_the_bytes_are_the_planners(
    tmp_path, tiny_model_dir, layout, bucket_mb, machines, dtype
):
    """Train ranks stream two versions to three replicas on two machines (one relays to its machine-mate): every
    replica holds the trainer's own gathered weights bitwise (in the sync dtype), and the bytes the train ranks sent
    equal the planner's prediction from the model's config alone."""
    env = {}
    if dtype == "staged":
        from parallel.weight_sync import STAGE_ENV

        dtype, env = "float32", {STAGE_ENV: "1"}
    if dtype == "shared":
        dtype, env = "float32", {"HEXRL_TEST_HANDOVER": "shared"}
        leftovers = set(Path("/dev/shm").glob("hexrl-weights-*"))
    reports = run_sync_worker(tiny_model_dir, layout, bucket_mb, machines, dtype, tmp_path, env)
    n_train = layout[0] * layout[1] * layout[2]
    n = n_train + len(machines.split(","))
    assert sorted(reports) == list(range(n)) and all(r["ok"] for r in reports.values()), reports
    head = reports[0]
    assert head["sent_v1"] == head["sent_v2"] == head["predicted"] > 0, head
    if env.get("HEXRL_TEST_HANDOVER") == "shared":
        # the relay mapped both owners' slots each version, its machine-mate none (it gets the wire); no file is left
        relay, mate = reports[n_train], reports[n_train + 1]
        assert relay["opened_v1"] == relay["opened_v2"] == layout[2] and mate["opened_v1"] == 0, reports
        assert set(Path("/dev/shm").glob("hexrl-weights-*")) <= leftovers
    if bucket_mb < 1:
        assert head["buckets"] >= 10  # really bucket by bucket


def test_train_ranks_send_the_planned_bytes_every_step(tmp_path, tiny_model_dir):
    """A plan from schedule.py with two rollout replicas: every step's weight_sync_bytes (what the train ranks
    sent) equals the plan's predicted sync_bytes, and so does weight_sync_predicted_bytes."""
    plan = tmp_path / "plan.json"
    cmd = [sys.executable, "schedule.py", "--cluster", "exp/clusters/cpu.yaml", "--model", str(tiny_model_dir)]
    cmd += ["--nproc", "4", "--train-layout", "2,1,1", "--precision", "fp32", "--weight-bucket-mb", "0.02"]
    subprocess.run([*cmd, "--out", str(plan), "--quiet"], cwd=ROOT, env=ENV, check=True, timeout=120)
    predicted = json.loads(plan.read_text())["predicted"]["sync_bytes"]
    replicas = json.loads(plan.read_text())["rollout"]["replicas"]
    assert len(replicas) == 2
    metrics, ledger = run_train(tmp_path, tiny_model_dir, 1, 3, [f"plan.path={plan}", "dist.weight_bucket_mb=0.02"])
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["weight_sync_bytes"] == m["weight_sync_predicted_bytes"] == predicted, m
        assert m["weight_sync_dtype"] == "float32"


def test_dynamic_sampling_and_overlong_penalty_end_to_end(tmp_path, tiny_model_dir):
    """A real run with DAPO's dynamic sampling and soft overlong penalty: flat groups (the tiny random model fails
    nearly everything) are dropped up to the limit per step and replaced; the ledger holds every group exactly once,
    trained or dropped, and the steps still train full batches within the staleness bound."""
    extra = ["train.dynamic_sampling_max_discards=2", "train.overlong=penalty", "train.overlong_buffer_tokens=8"]
    metrics, ledger = run_train(tmp_path, tiny_model_dir, 1, 3, extra)
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


def test_colocated_gpu_caps_each_role_and_refuses_layouts_gloo_cannot_run(monkeypatch):
    """share_device on a (pretend) GPU: a default plan (no rollout section: one single-rank replica per rollout
    rank) caps each role at its memory fraction; a train layout of more than one rank, or a TP rollout replica, is
    one SetupError naming the layout (gloo cannot gather CUDA tensors)."""
    from types import SimpleNamespace

    import torch

    from config import load_config
    from errors import SetupError
    from parallel.rankmap import RolloutReplica
    from train import share_device

    caps = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: caps.append((f, device)))
    cfg = load_config(["config=gpu_single"])
    gpu = torch.device("cuda", 0)
    one = [RolloutReplica(0, [0], 1.0)]
    for role, fraction in (("train", cfg.dist.train_memory_fraction), ("rollout", cfg.dist.rollout_memory_fraction)):
        share_device(cfg, SimpleNamespace(role=role, dp=1, tp=1, pp=1, replicas=one), gpu)
        assert caps[-1] == (fraction, gpu) and fraction > 0
    bad = [
        (dict(dp=2, tp=1, pp=1, replicas=one), "dp=2"),
        (dict(dp=1, tp=1, pp=2, replicas=one), "pp=2"),
        (dict(dp=1, tp=1, pp=1, replicas=[RolloutReplica(0, [0, 1], 1.0)]), "rollout replicas of TP 1"),
    ]
    for layout, named in bad:
        with pytest.raises(SetupError, match=named):
            share_device(cfg, SimpleNamespace(role="train", **layout), gpu)
    before = len(caps)  # on CPU every layout runs colocated and nothing is capped
    share_device(cfg, SimpleNamespace(role="train", dp=2, tp=1, pp=1, replicas=one), torch.device("cpu"))
    assert len(caps) == before
