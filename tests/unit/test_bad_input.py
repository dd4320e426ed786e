"""Bad input, in process: checkpoint refusal, non-finite steps, weight-sync corruption and unsafe code patterns
(adversarial model outputs, scored by the math-verify worker: tests/dist/test_reward.py; the launch-level cases,
train.py run for real: tests/e2e/test_bad_launch.py).
"""

from __future__ import annotations

import ast
import copy
import json
import math
import subprocess

import pytest
import torch
from tiny import ROOT

torch.set_num_threads(1)


def test_bad_rows_skip_is_counted(tmp_path):
    from config import DataConfig
    from tasks import load_task

    path = tmp_path / "rows.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(10)]
    rows[2] = {"answer": "#### 3"}
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")

    class Tok:
        chat_template = None

    train, test = load_task(DataConfig(task=str(path), on_bad_row="skip", num_test=0), Tok())
    assert len(train) + len(test) == 9  # the two bad rows are skipped, every good one kept
    assert len({r["prompt_id"] for r in train + test}) == 9


def test_prompts_too_long_for_the_rollout_are_skipped_or_named(tmp_path):
    from config import DataConfig
    from tasks import DataError, load_task

    path = tmp_path / "rows.jsonl"
    rows = [{"question": "What is " + "1+" * i + "1?", "answer": f"#### {i + 1}"} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    class Tok:  # one token per character: prompt length grows with i
        chat_template = None

        def __call__(self, texts):
            return {"input_ids": [list(t) for t in texts]}

    cfg = DataConfig(task=str(path), on_bad_row="skip", num_test=0)
    every, _ = load_task(cfg, Tok())
    limit = sorted(len(r["prompt"]) for r in every)[5]  # the 6 shortest fit
    kept, _ = load_task(cfg, Tok(), max_prompt_tokens=limit)
    assert len(kept) == 6 and all(len(r["prompt"]) <= limit for r in kept)
    with pytest.raises(DataError, match=rf"has \d+ tokens, more than the {limit} allowed .*; 4 such rows"):
        load_task(DataConfig(task=str(path), on_bad_row="fail", num_test=0), Tok(), max_prompt_tokens=limit)
    with pytest.raises(DataError, match="no train prompt fits in 3 tokens"):
        load_task(cfg, Tok(), max_prompt_tokens=3)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_resume_refuses_other_config_and_incomplete_checkpoints(tmp_path):
    from checkpoint import CheckpointError, find_resume, latest_complete, load_head_state, truncate_logs
    from config import load_config, to_dict

    run = tmp_path / "r"
    for step, complete in ((2, True), (4, True), (6, False)):
        d = run / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        saved = load_config(["train.lr=3e-4", "max_staleness=2"])
        (d / "state.json").write_text(json.dumps({"config": to_dict(saved), "version": step}))
        if complete:
            (d / "COMPLETE").write_text("")
    (run / "checkpoints" / ".tmp_step_8").mkdir()
    assert latest_complete(run) == run / "checkpoints" / "step_4"  # the incomplete and temp dirs never count

    cfg = load_config(
        [
            f"logging.run_dir={tmp_path}",
            "logging.run_name=r",
            "resume=auto",
            "train.lr=3e-4",
            "max_staleness=2",
            "train.total_steps=999",
        ]
    )  # total_steps may change on resume
    assert find_resume(cfg) == run / "checkpoints" / "step_4"
    assert load_head_state(find_resume(cfg), cfg)["version"] == 4
    other = load_config(
        [
            f"logging.run_dir={tmp_path}",
            "logging.run_name=r",
            "resume=auto",
            "train.lr=1e-4",
            "max_staleness=2",
            "train.seed=7",
        ]
    )
    with pytest.raises(CheckpointError, match=r"different config: staleness|train\.lr .*3e-4|train\.lr") as e:
        load_head_state(find_resume(other), other)
    assert "train.lr (checkpoint 0.0003, now 0.0001)" in str(e.value) and "train.seed" in str(e.value)
    with pytest.raises(CheckpointError, match="incomplete"):
        find_resume(load_config([f"resume={run / 'checkpoints' / 'step_6'}"]))
    empty = load_config([f"logging.run_dir={tmp_path}", "logging.run_name=fresh", "resume=auto"])
    assert find_resume(empty) is None  # resume=auto on a new run starts fresh

    (run / "ledger.jsonl").write_text("a\nb\nc\n")
    assert truncate_logs(run, {"ledger.jsonl": 4}) == {"ledger.jsonl": 2}
    assert (run / "ledger.jsonl").read_text() == "a\nb\n"
    with pytest.raises(CheckpointError, match="does not belong"):
        truncate_logs(run, {"ledger.jsonl": 100})


# ---------------------------------------------------------------------------------------------- non-finite steps
def test_nonfinite_steps_are_skipped_then_stop(world_of_one, tmp_path):
    from dist_parallel_worker import make_trajectories, tiny_model, trainer_config

    from buffer import Trajectory
    from checkpoint import CheckpointWriter
    from config import load_config
    from head import NonFiniteError
    from parallel.channel import Channel
    from parallel.groups import build_groups
    from parallel.trainer import Trainer
    from plan import make_train_plan
    from runlog import RunLog
    from train import TrainHead

    model = tiny_model("llama")
    groups = build_groups(make_train_plan(1, 1, 1, [(0, model.config.num_hidden_layers)]))
    trainer = Trainer(copy.deepcopy(model), groups, trainer_config(lr=1e-2, micro_batch_tokens=64), "cpu")
    trajs = [
        Trajectory(
            prompt_id=t.prompt_id,
            sample_idx=i % 2,
            prompt_ids=t.prompt_ids,
            response_ids=t.response_ids,
            behav_logprobs=t.behav_logprobs,
            versions=[0] * len(t.response_ids),
            reward=float(i % 2),
            group_id=i // 2,
        )
        for i, t in enumerate(make_trajectories(model, 4, 1.0))
    ]
    cfg = load_config(
        [
            "train.max_nonfinite_steps=2",
            "train.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "logging.progress=false",
            "logging.wandb=disabled",
        ]
    )
    log = RunLog(cfg, tmp_path, {})
    head = TrainHead(
        cfg,
        groups,
        trainer,
        [{"prompt_id": 0}],
        [],
        log,
        torch.device("cpu"),
        Channel([]),
        CheckpointWriter(tmp_path, 2, None, None),
    )
    head.buffer.version = 1

    def batch(ts):
        return [(None, [copy.deepcopy(t) for t in ts[:2]]), (None, [copy.deepcopy(t) for t in ts[2:]])]

    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    poisoned = [copy.deepcopy(t) for t in trajs]
    poisoned[1].behav_logprobs[0] = math.nan  # a non-finite input: no train step at all
    stats, updated = head.train_on(batch(poisoned))
    assert not updated and stats["nonfinite_skipped"] == 1
    head.check_finite(updated)
    assert all(torch.equal(p, before[n]) for n, p in trainer.params.items())

    # a loss that turns non-finite inside the trainer: the optimizer step is skipped (weights, AdamW state intact)
    name = next(n for n in trainer.params if "layers.0" in n and trainer.params[n].dim() == 2)
    with torch.no_grad():
        trainer.params[name][0, 0] = math.inf
    poisoned_before = {n: p.detach().clone() for n, p in trainer.params.items()}
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row .*max_nonfinite_steps=2"):
        stats, updated = head.train_on(batch(trajs))
        assert not updated and not math.isfinite(stats["grad_norm"])
        head.check_finite(updated)
    assert all(torch.equal(p, poisoned_before[n]) for n, p in trainer.params.items())
    assert not trainer.optimizer.state  # AdamW moments never saw a NaN

    with torch.no_grad():  # healthy again: a real update, the streak resets
        trainer.params[name].copy_(before[name])
    stats, updated = head.train_on(batch(trajs))
    assert updated and math.isfinite(stats["loss"])
    head.check_finite(updated)
    assert head.nonfinite.in_a_row == 0
    assert any(not torch.equal(p, before[n]) for n, p in trainer.params.items())
    log.close()
    ledger = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [e["updated"] for e in ledger] == [False] * 4 + [False] * 4 + [True] * 4  # every batch accounted for
    metrics = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in metrics  # strict JSON: non-finite values are null


# ---------------------------------------------------------------------------------------------- weights, rewards, code
def test_corrupted_weights_are_refused(world_of_one, monkeypatch):
    """A bucket sealed by the sender arrives with one ulp of one weight changed: the receiver refuses it, naming the
    version and the bucket; the intact bucket is applied bitwise."""
    from parallel import sync_layout, weight_sync
    from parallel.weight_sync import WeightSyncError, bucket_meta, payload_view, receive_version, seal

    sd = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5)}
    (bucket,) = sync_layout.sync_buckets([(n, t.numel()) for n, t in sd.items()], [(0, 1)], 4, 1 << 20)
    buf = torch.empty(bucket.wire_bytes, dtype=torch.uint8)
    payload_view(buf, bucket, torch.float32).copy_(torch.cat([t.reshape(-1) for t in sd.values()]))
    seal(buf, bucket, verify=True)
    meta = bucket_meta(bucket, {n: t.shape for n, t in sd.items()}, torch.float32)
    msg = {"version": 7, "buckets": [meta], "owners": [0], "source": None, "forward": [], "verify": True}
    corrupted = buf.clone()
    one = payload_view(corrupted, bucket, torch.float32)
    one[5] = torch.nextafter(one[5], torch.tensor(math.inf))  # one ulp of one weight

    def receive(wire):
        monkeypatch.setattr(weight_sync.dist, "recv", lambda t, src, group: t.copy_(wire))
        got = {}
        receive_version(msg, {("owners", 0): None}, torch.device("cpu"), lambda b, last: got.update(b), 1.0)
        return got

    got = receive(buf)
    assert all(torch.equal(got[n], sd[n]) for n in sd)
    with pytest.raises(WeightSyncError, match="checksum mismatch for version 7 .*a.weight"):
        receive(corrupted)


def test_no_eval_or_exec_and_only_safe_torch_load():
    # the project's own files: tracked by git, or (no git) outside any virtual environment
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        files = [ROOT / line for line in listed.stdout.split()]
    else:
        venvs = {v.parent for v in ROOT.rglob("pyvenv.cfg")}
        files = [p for p in ROOT.rglob("*.py") if not any(v in p.parents for v in venvs)]
    assert files
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {f.id}()")
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "load"
                and isinstance(f.value, ast.Name)
                and f.value.id == "torch"
            ):
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not safe:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.load without weights_only=True")
            if (
                isinstance(f, ast.Attribute)
                and f.attr in ("loads", "load")
                and isinstance(f.value, ast.Name)
                and f.value.id == "pickle"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} pickle.{f.attr}")
    assert not offenders, offenders
