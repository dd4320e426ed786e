"""3D-parallel trainer: packing units, plan validation and single-rank trainer checks (the multi-rank equivalence run
against the 1-process reference: tests/dist/test_parallel_ranks.py)."""

import os
import random
import sys

import pytest
import torch

from parallel.groups import build_groups
from parallel.packing import balanced_partition, dynamic_microbatches
from plan import PlanError, make_train_plan, validate_plan

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))


# ----------------------------------------------------------------------------------------------------------------
# packing


def brute_force_dynamic(lengths, capacity, k_min):
    """Algorithm 1 written out step by step, to compare against."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins = []
    for i in order:
        fits = [b for b in bins if sum(lengths[j] for j in b) + lengths[i] <= capacity]
        if len(bins) < k_min or not fits:
            bins.append([i])
        else:
            min(fits, key=lambda b: (len(b), bins.index(b))).append(i)
    return [sorted(b) for b in bins]


def test_dynamic_microbatches_example():
    # sorted: 7(idx1) 5(idx3) 4(idx0) 3(idx2) 1(idx4); capacity 8, k_min 2
    # 7 -> new A; 5 -> new B (k_min); 4 fits B only -> B=[5,4]=9? no, 9 > 8 -> new C;
    # 3 fits B (8) -> B; 1 fits A (8) and C (5); A has 1 seq, C has 1 seq -> first (A)
    assert dynamic_microbatches([4, 7, 3, 5, 1], capacity=8, min_microbatches=2) == [[1, 4], [2, 3], [0]]


def test_dynamic_microbatches_invariants():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        cap, k_min = rng.randint(50, 200), rng.randint(1, 6)
        bins = dynamic_microbatches(lengths, cap, k_min)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= cap for b in bins)
        assert len(bins) >= min(k_min, len(lengths))
        assert bins == brute_force_dynamic(lengths, cap, k_min)


def test_dynamic_microbatches_bad_input():
    with pytest.raises(ValueError, match="micro_batch_tokens=10"):
        dynamic_microbatches([3, 11], capacity=10)
    with pytest.raises(ValueError, match="capacity"):
        dynamic_microbatches([3], capacity=0)


def test_balanced_partition():
    parts = balanced_partition([10, 1, 9, 2, 8, 3], 2)
    # longest first to the lightest part: 10->0, 9->1, 8->1 (9<10), 3->0, 2->0 (13 vs 17), 1->0? (15 vs 17) -> 0
    assert parts == [[0, 1, 3, 5], [2, 4]]
    assert balanced_partition([5], 3) == [[0], [], []]
    rng = random.Random(1)
    for _ in range(100):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 40))]
        parts = balanced_partition(lengths, 4)
        loads = [sum(lengths[i] for i in p) for p in parts]
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        assert max(loads) - min(loads) <= max(lengths)  # greedy LPT bound


# ----------------------------------------------------------------------------------------------------------------
# plan validation


def test_plan_roundtrip_and_errors():
    plan = make_train_plan(2, 2, 2, [(0, 3), (3, 4)], world_size=10)
    train, rollout, dp, tp, pp, layers = validate_plan(plan)
    assert train == list(range(8)) and rollout == [8, 9] and (dp, tp, pp) == (2, 2, 2) and layers == [(0, 3), (3, 4)]
    assert [plan["ranks"][r]["tp"] for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [plan["ranks"][r]["dp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [plan["ranks"][r]["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]

    bad = make_train_plan(2, 1, 1, [(0, 4)])
    bad["ranks"][1]["dp"] = 0
    with pytest.raises(PlanError, match="rank 1 has"):
        validate_plan(bad)
    bad = make_train_plan(1, 1, 2, [(0, 2), (2, 4)])
    bad["train"]["stages"][1]["layers"] = [3, 4]
    with pytest.raises(PlanError, match="contiguous"):
        validate_plan(bad)
    bad = make_train_plan(2, 1, 1, [(0, 4)])
    bad["train"]["dp"] = 3
    with pytest.raises(PlanError, match="dp\\*tp\\*pp"):
        validate_plan(bad)
    with pytest.raises(PlanError, match="missing field"):
        validate_plan({"world_size": 1})


# ----------------------------------------------------------------------------------------------------------------
# single rank (world of 1): bf16 path, bad trajectories, checkpoint round trip


@pytest.mark.parametrize("pp, pp_rank", [(2, 0), (4, 0), (4, 1), (4, 3)])
def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_alive(pp, pp_rank):
    """Activation memory under 1F1B: stage k of pp holds at most pp - k micro-batches between forward and
    backward (the first stage pp), whatever the minibatch's size -- not the whole minibatch."""
    import types

    from parallel.pipeline import train_1f1b

    m = 12
    w = torch.ones(3, requires_grad=True)
    live, peak, order = [0], [0], []
    last = pp_rank == pp - 1

    def exchange(sends, recvs):
        return [torch.ones(shape) for shape, _ in recvs]

    links = types.SimpleNamespace(first=pp_rank == 0, last=last, prev=0, next=0, exchange=exchange)

    def step(i, x):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        y = w * (i + 1) if x is None else w * x
        y.register_hook(lambda g, i=i: (order.append(i), live.__setitem__(0, live[0] - 1), g)[-1])
        return y.sum() if last else y

    train_1f1b(links, m, lambda i: (3,), step, pp_rank, pp)
    assert order == list(range(m)) and live[0] == 0  # every micro-batch backwarded once, in order
    assert peak[0] == min(pp - pp_rank, m)


def test_activation_checkpointing_is_exact_and_saves_less(world_of_one):
    """Per-layer checkpointing (train.activation_checkpointing) gives the loss and every gradient bit for bit (fp32,
    CPU), and really is on: far fewer bytes are saved for backward than without it."""
    import copy

    from dist_parallel_worker import TEMPERATURE, make_trajectories, tiny_model, trainer_config

    from parallel.trainer import Trainer

    model = tiny_model("llama")
    trajs = make_trajectories(model, 6, TEMPERATURE)
    groups = build_groups(make_train_plan(1, 1, 1, [(0, 4)]))
    out = {}
    for on in (False, True):
        trainer = Trainer(
            copy.deepcopy(model), groups, trainer_config(activation_checkpointing=on), "cpu", temperature=TEMPERATURE
        )
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = trainer.compute_gradients(trajs)
        out[on] = (loss, {n: p.grad.clone() for n, p in trainer.params.items()}, sum(saved))
    assert out[True][0] == out[False][0]
    assert all(torch.equal(out[True][1][n], g) for n, g in out[False][1].items())
    assert out[True][2] < 0.5 * out[False][2], (out[True][2], out[False][2])


@pytest.mark.parametrize(
    "key, value",
    [
        ("behav_correction", "tis"),
        ("behav_correction", "mis-seq"),
        ("behav_correction", "mis-geo"),
        ("behav_correction", "icepop"),
        ("loss_aggregation", "seq-mean-token-mean"),
        ("loss_aggregation", "seq-mean-token-sum"),
        ("kl_coef", 0.5),
        ("overlong", "mask"),
    ],
)
def test_every_loss_key_reaches_the_gradient(world_of_one, key, value):
    """Changing any of the loss's config keys from its default changes the gradient the trainer computes."""
    import copy

    from dist_parallel_worker import TEMPERATURE, make_trajectories, tiny_model, trainer_config

    from parallel.trainer import Trainer

    model = tiny_model("llama")
    trajs = make_trajectories(model, 6, TEMPERATURE)
    trajs[1].finish_reason = "length"
    for t in trajs:  # behaviour 0.3 nats off everywhere: every correction has work to do
        t.behav_logprobs = [x - 0.3 for x in t.behav_logprobs]
    groups = build_groups(make_train_plan(1, 1, 1, [(0, 4)]))
    base = {"behav_imp_weight_cap": 1.5, "behav_correction_bounds": [0.8, 1.25], "recompute_prox_logprobs": True}
    out = []
    for overrides in (base, {**base, key: value}):
        trainer = Trainer(copy.deepcopy(model), groups, trainer_config(**overrides), "cpu", temperature=TEMPERATURE)
        if key == "kl_coef":  # the reference is the initial weights: move the policy off it first
            with torch.no_grad():
                for p in trainer.params.values():
                    p.mul_(1.05)
        trainer.compute_gradients(trajs)
        out.append(torch.cat([p.grad.reshape(-1) for p in trainer.params.values()]))
    assert (out[0] - out[1]).norm() > 1e-4 * out[0].norm(), (key, value)


def test_overlong_mask_takes_truncated_responses_out_of_the_loss(world_of_one):
    """train.overlong=mask: a truncated response contributes exactly what a zero-advantage one would -- nothing --
    while its tokens stay in the token-mean denominator."""
    import copy

    from dist_parallel_worker import TEMPERATURE, make_trajectories, tiny_model, trainer_config

    from parallel.trainer import Trainer

    model = tiny_model("llama")
    trajs = make_trajectories(model, 6, TEMPERATURE)
    groups = build_groups(make_train_plan(1, 1, 1, [(0, 4)]))
    truncated = copy.deepcopy(trajs)
    truncated[2].finish_reason = "length"
    silenced = copy.deepcopy(trajs)
    silenced[2].advantage = 0.0

    def grads(cfg, batch):
        trainer = Trainer(copy.deepcopy(model), groups, cfg, "cpu", temperature=TEMPERATURE)
        loss = trainer.compute_gradients(batch)
        return loss, {n: p.grad.clone() for n, p in trainer.params.items()}

    masked = grads(trainer_config(overlong="mask"), truncated)
    want = grads(trainer_config(), silenced)
    kept = grads(trainer_config(), truncated)  # overlong=none trains on it as usual
    assert masked[0] == pytest.approx(want[0], abs=1e-9) and masked[0] != pytest.approx(kept[0], abs=1e-6)
    assert all(torch.allclose(masked[1][n], g, rtol=1e-6, atol=1e-9) for n, g in want[1].items())


def test_single_rank_trainer(world_of_one):
    from dist_parallel_worker import TEMPERATURE, make_trajectories, reference, tiny_model, trainer_config

    from parallel.trainer import Trainer

    model = tiny_model("qwen2")
    cfg = trainer_config(
        lr=1e-3, eps=1e-6, grad_clip=1.0, ppo_minibatches=2, micro_batch_tokens=24, behav_imp_weight_cap=3.0
    )
    trajs = make_trajectories(model, 6, TEMPERATURE)
    groups = build_groups(make_train_plan(1, 1, 1, [(0, 4)]))
    with pytest.raises(PlanError, match="world_size=2"):
        build_groups(make_train_plan(2, 1, 1, [(0, 4)]))
    with pytest.raises(ValueError, match="cover layers"):
        Trainer(model, build_groups(make_train_plan(1, 1, 1, [(0, 3)])), cfg, "cpu", temperature=TEMPERATURE)

    import copy

    trainer = Trainer(copy.deepcopy(model), groups, cfg, "cpu", temperature=TEMPERATURE)
    # bad input: one clear message each
    broken = copy.deepcopy(trajs[0])
    broken.behav_logprobs = broken.behav_logprobs[:-1]
    with pytest.raises(ValueError, match="trajectory 0: .* behav_logprobs"):
        trainer.train_step([broken])
    broken = copy.deepcopy(trajs[0])
    broken.response_ids = [0] * 40
    broken.behav_logprobs = [0.0] * 40
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        trainer.train_step([broken, trajs[1]])
    with pytest.raises(ValueError, match="ppo_minibatches=2"):
        trainer.train_step(trajs[:1])

    state = trainer.checkpoint_state()
    metrics = trainer.train_step(trajs)
    _, _, ref_losses, ref_after = reference(model, trajs, cfg)
    assert metrics["loss"] == pytest.approx(sum(ref_losses) / 2, rel=1e-5)
    assert metrics["trained_tokens"] == sum(len(t.response_ids) for t in trajs)
    assert 0.0 <= metrics["pg_clipfrac"] <= 1.0 and metrics["importance_weight_max"] > 1.0
    after = trainer.gather_full_state_dict()
    for n, t in ref_after.items():
        assert (after[n] - t).norm() <= 1e-5 * t.norm(), n

    # a shard saved under another layout (here: one of 2 FSDP shards) is refused, naming both layouts
    foreign = {**state, "layout": {**state["layout"], "dp": 2, "fsdp": True}}
    with pytest.raises(ValueError, match="'dp': 2.*does not match.*'dp': 1.*same train layout"):
        trainer.load_checkpoint_state(foreign)

    # resume: restoring the pre-step state and stepping again reproduces the same parameters exactly
    trainer.load_checkpoint_state(state)
    trainer.train_step(trajs)
    again = trainer.gather_full_state_dict()
    assert all(torch.equal(again[n], after[n]) for n in after)

    # bf16 compute (fp32 master weights): close to, not equal to, fp32
    bf16 = Trainer(copy.deepcopy(model), groups, cfg, "cpu", temperature=TEMPERATURE, compute_dtype=torch.bfloat16)
    m16 = bf16.train_step(trajs)
    assert all(p.dtype == torch.float32 for p in bf16.params.values())
    assert m16["loss"] == pytest.approx(metrics["loss"], rel=0.05, abs=0.02)
