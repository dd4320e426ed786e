"""exp/peer_trl.py gives TRL's GRPOTrainer hexrl's workload: its settings are read from hexrl's config, and the
prompts come in hexrl's order (the benchmark itself is not part of the suite)."""

import dataclasses

import pytest
from peer_trl import WORKLOADS, prompts_in_hexrl_order, trl_settings

from config import load_config
from head import DataOrder


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_trl_settings_follow_the_config(workload):
    cfg = load_config([f"config={WORKLOADS[workload]}"])
    s = trl_settings(cfg, world_size=2, output_dir="out")
    r, t = cfg.rollout, cfg.train
    assert s["per_device_train_batch_size"] * 2 == t.prompts_per_step * r.samples_per_prompt
    assert s["num_generations"] == r.samples_per_prompt and s["max_completion_length"] == r.max_new_tokens
    assert (s["learning_rate"], s["adam_beta1"], s["adam_beta2"], s["weight_decay"]) == (t.lr, *t.betas, t.weight_decay)
    assert s["max_grad_norm"] == t.grad_clip and s["epsilon"] == t.clip_eps and s["beta"] == t.kl_coef
    assert s["max_steps"] == t.total_steps and not s["shuffle_dataset"] and s["lr_scheduler_type"] == "constant"
    changed = dataclasses.replace(cfg)
    changed.rollout = dataclasses.replace(r, samples_per_prompt=4, max_new_tokens=77, temperature=0.7, top_k=-1)
    changed.train = dataclasses.replace(
        t, lr=3e-5, prompts_per_step=6, kl_coef=0.01, loss_aggregation="seq-mean-token-mean"
    )
    s = trl_settings(changed, world_size=3, output_dir="out")
    assert s["per_device_train_batch_size"] == 8 and s["num_generations"] == 4 and s["max_completion_length"] == 77
    assert s["temperature"] == 0.7 and s["top_k"] == 0 and s["learning_rate"] == 3e-5 and s["beta"] == 0.01
    assert s["loss_type"] == "grpo"
    with pytest.raises(ValueError, match="does not split over 5 TRL processes"):
        trl_settings(changed, world_size=5, output_dir="out")


def test_trl_settings_are_grpo_config_fields():
    trl = pytest.importorskip("trl")  # exp/requirements-peer.txt
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    cfg = load_config(["config=cpu_demo"])
    assert set(trl_settings(cfg, 2, "out")) <= fields


def test_prompts_come_in_hexrl_order():
    rows = [{"prompt_id": i, "prompt": f"p{i}"} for i in range(10, 30)]
    order = DataOrder([r["prompt_id"] for r in rows], seed=4)
    got = prompts_in_hexrl_order(rows, seed=4, n=45)  # past one epoch: the next permutation follows
    assert [r["prompt_id"] for r in got] == [order.next() for _ in range(45)]
