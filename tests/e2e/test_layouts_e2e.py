"""torchrun train.py with TP and PP plans runs end to end; with max_staleness=0 the step-1 loss and grad
norm are the same for every layout (the trajectories do not depend on the layout: per-request seeds)."""

import json

import pytest
from tiny import torchrun

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]


def run_layout(tmp_path, model_dir, dp, tp, pp):
    from plan import make_train_plan, stage_layer_ranges

    plan = make_train_plan(dp, tp, pp, [tuple(x) for x in stage_layer_ranges(2, pp)], world_size=dp * tp * pp + 1)
    plan_file = tmp_path / f"plan_{dp}{tp}{pp}.json"
    plan_file.write_text(json.dumps(plan))
    name = f"l{dp}{tp}{pp}"
    proc = torchrun(
        dp * tp * pp + 1,
        [
            f"model.path={model_dir}",
            f"plan={plan_file}",
            f"logging.run_dir={tmp_path}",
            f"logging.run_name={name}",
            "train.total_steps=1",
            "train.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=16",
            "data.num_test=4",
            "data.num_train=100",
            "max_staleness=0",
            "logging.progress=false",
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl") if '"loss"' in x]
    return step[0]


def test_step1_loss_and_grad_norm_match_across_layouts(tmp_path, tiny_model_dir):
    results = {layout: run_layout(tmp_path, tiny_model_dir, *layout) for layout in LAYOUTS}
    ref = results[LAYOUTS[0]]
    for layout, m in results.items():
        for key in ("loss", "grad_norm", "trained_tokens", "reward_mean"):
            assert m[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (layout, key, m[key], ref[key])
