"""hexrl against TRL's GRPOTrainer on the same workload, side by side, at equal training wall time.

    pip install -r exp/requirements-peer.txt
    python exp/peer_trl.py                                   # demo and long-tailed workloads, 2 pairs each, 270 s
    python exp/peer_trl.py --workloads demo --pairs 1 --seconds 60 --out /tmp/peer

A pair runs TRL (two data-parallel processes under torchrun: the two cores, as a user with one box launches it)
and hexrl's own command (`torchrun --nproc_per_node=4 train.py config=<workload>`), on the demo also that command
with max_staleness=0 (synchronous), each leading in turn. Both train from the same warm start on the same prompts
in the same order (hexrl's DataOrder), with the same reward (reward_math.score), batch (B prompts x G samples),
sampling, AdamW settings and constant lr, and both are evaluated the same way: greedy accuracy on the held-out rows
through hexrl's own Generator, on the weights of the step. TRL's clock stops while it evaluates; hexrl's rollout
ranks evaluate between their generation steps, on its clock (against hexrl). Printed per workload: steps, trained
response tokens/s, held-out accuracy at the end, tokens/s over TRL's; written to OUT/summary.json with the curves.

What cannot be matched: TRL is synchronous (generate, then train, on the same processes: no staleness, eta = 0);
hexrl's loss is decoupled PPO (token-mean, behaviour log-probs from the sampler), TRL's `dapo` loss (token-mean over
the global batch) on its own recomputed log-probs; TRL pads micro-batches, hexrl packs them. TRL generates with
HF `generate` (padded; `--trl-continuous-batching` switches to transformers' paged engine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from config import Config, load_config  # noqa: E402

WORKLOADS = {"demo": "cpu_demo", "tail": "cpu_tail"}
# who runs in each pair: the demo also runs hexrl synchronous (max_staleness=0), what its default must not trail
SYSTEMS = {"demo": ("trl", "hexrl", "hexrl-eta0"), "tail": ("trl", "hexrl")}


def trl_settings(cfg: Config, world_size: int, output_dir: str) -> dict:
    """GRPOConfig keyword arguments that give TRL hexrl's workload: one optimizer step per batch of
    prompts_per_step x samples_per_prompt completions, the same sampling, AdamW and constant learning rate."""
    r, t = cfg.rollout, cfg.train
    batch = t.prompts_per_step * r.samples_per_prompt
    if batch % world_size:
        raise ValueError(f"a batch of {batch} completions does not split over {world_size} TRL processes")
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch // world_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=t.ppo_minibatches,  # hexrl: ppo_minibatches optimizer steps per batch
        num_generations=r.samples_per_prompt,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=max(r.top_k, 0),  # hexrl -1 = TRL 0: no top-k
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        adam_epsilon=t.eps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        beta=t.kl_coef,
        epsilon=t.clip_eps,
        loss_type="dapo" if t.loss_aggregation == "token-mean" else "grpo",
        scale_rewards="group",
        mask_truncated_completions=t.overlong == "mask",
        shuffle_dataset=False,  # the dataset is already in hexrl's order
        max_steps=t.total_steps,
        seed=t.seed,
        data_seed=cfg.data.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def prompts_in_hexrl_order(train_rows: list[dict], seed: int, n: int) -> list[dict]:
    from head import DataOrder

    by_id = {r["prompt_id"]: r for r in train_rows}
    order = DataOrder(list(by_id), seed)
    return [by_id[order.next()] for _ in range(n)]


# ----------------------------------------------------------------------------------------- TRL, one process
def trl_worker(args: argparse.Namespace) -> None:
    """One of TRL's data-parallel processes (under torchrun). Rank 0 writes OUT/metrics.jsonl in the schema of
    hexrl's runs: a line per step (elapsed_s, trained_tokens) and eval lines (eval_accuracy)."""
    import copy

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from generator import Generator, SamplingParams
    from reward_math import score
    from tasks import load_task

    cfg = load_config([f"config={args.config}"])
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    prompt_limit = min(cfg.data.max_prompt_tokens, cfg.rollout.max_seq_len - cfg.rollout.max_new_tokens)
    train_rows, test_rows = load_task(cfg.data, tok, prompt_limit)  # as train.py reads them
    rows = prompts_in_hexrl_order(train_rows, cfg.data.seed, cfg.train.prompts_per_step * cfg.train.total_steps)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = trl_settings(cfg, world, str(Path(args.out) / "trl"))
    settings["use_transformers_continuous_batching"] = args.trl_continuous_batching
    out = Path(args.out)
    is_writer = int(os.environ.get("RANK", "0")) == 0

    def reward(prompts, completions, answer, **_):
        return [score(c, a) for c, a in zip(completions, answer)]

    def held_out_accuracy(policy) -> float:
        """Greedy accuracy on the held-out rows through hexrl's Generator, on a copy of the step's weights."""
        copy_ = copy.deepcopy(policy).eval()
        gen = Generator.from_config(copy_, cfg.rollout)
        greedy = SamplingParams(
            temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=[tok.eos_token_id]
        )
        outs = gen.generate([tok(r["prompt"])["input_ids"] for r in test_rows], greedy)
        return sum(
            score(tok.decode(o.token_ids, skip_special_tokens=True), r["answer"]) > 0 for o, r in zip(outs, test_rows)
        ) / len(test_rows)

    class Budget(TrainerCallback):
        """Stops at `seconds` of training (evals excluded), logs per-step tokens and the held-out evals."""

        def __init__(self):
            self.train_s, self.t0 = 0.0, None
            self.metrics = open(out / "metrics.jsonl", "w") if is_writer else None  # noqa: SIM115

        def write(self, line: dict) -> None:
            if self.metrics is not None:
                self.metrics.write(json.dumps(line) + "\n")
                self.metrics.flush()

        def evaluate(self, step: int, model) -> None:
            if is_writer:
                acc = held_out_accuracy(model)
                self.write({"step": step, "eval_accuracy": acc, "eval_n": len(test_rows), "train_s": self.train_s})
                print(f"[trl] step {step} held-out {acc:.3f} after {self.train_s:.0f} s of training", flush=True)
            dist.barrier()

        def on_train_begin(self, targs, state, control, model=None, **_):
            self.evaluate(0, model)
            self.t0 = time.perf_counter()

        def on_log(self, targs, state, control, logs=None, **_):
            if logs and "completions/mean_length" in logs:  # per step: completions of the whole batch
                tokens = logs["completions/mean_length"] * cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
                self.write(
                    {
                        "step": state.global_step,
                        "trained_tokens": tokens,
                        "reward_mean": logs.get("reward"),
                        "elapsed_s": self.train_s,
                    }
                )

        def on_step_end(self, targs, state, control, model=None, **_):
            self.train_s += time.perf_counter() - self.t0
            done = self.train_s >= args.seconds
            done_t = torch.tensor([float(done)])
            dist.all_reduce(done_t)  # every process stops at the same step
            if done_t.item() > 0 or state.global_step % cfg.logging.eval_every == 0:
                self.evaluate(state.global_step, model)
            control.should_training_stop = done_t.item() > 0
            self.t0 = time.perf_counter()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**settings),
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Budget()],
    )
    trainer.train()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------- the comparison
def summarize(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    steps = [m for m in lines if "trained_tokens" in m]
    evals = [m for m in lines if m.get("eval_accuracy") is not None]
    seconds = steps[-1]["elapsed_s"] if steps else 0.0
    tokens = sum(m["trained_tokens"] for m in steps)
    elapsed = {m["step"]: m["elapsed_s"] for m in steps}
    curve = [(elapsed.get(m["step"], 0.0), m["eval_accuracy"]) for m in evals]
    return {
        "steps": len(steps),
        "train_seconds": seconds,
        "trained_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "start_accuracy": curve[0][1] if curve else None,
        "end_accuracy": curve[-1][1] if curve else None,
        "curve": curve,
    }


def run_trl(config: str, seconds: float, out: Path, continuous_batching: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        __file__,
        "--trl-worker",
        "--config",
        config,
        "--seconds",
        str(seconds),
        "--out",
        str(out),
    ]
    cmd += ["--trl-continuous-batching"] if continuous_batching else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(out / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return summarize(out)


def run_hexrl(config: str, seconds: float, out: Path, extra: tuple[str, ...] = ()) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        "train.py",
        f"config={config}",
        f"train.max_train_seconds={seconds}",
        f"logging.run_dir={out.parent}",
        f"logging.run_name={out.name}",
        "logging.progress=false",
        *extra,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return summarize(out)


def plot_curves(summary: dict, path: Path) -> None:
    """Held-out greedy accuracy against training wall time: a panel per workload, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(5.5 * len(summary), 4), squeeze=False)
    colors = {"trl": "tab:orange", "hexrl": "tab:blue", "hexrl-eta0": "tab:green"}
    for ax, (name, runs) in zip(axes[0], summary.items()):
        for who, rs in runs.items():
            for i, r in enumerate(rs):
                t, acc = zip(*r["curve"]) if r["curve"] else ((), ())
                ax.plot(t, [100 * a for a in acc], "o-", ms=3, color=colors.get(who), alpha=1.0 if i == 0 else 0.5,
                        label=who if i == 0 else None)  # fmt: skip
        ax.set(title=name, xlabel="training wall time (s)", ylabel="held-out greedy accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="demo,tail", help=f"comma-separated, of {sorted(WORKLOADS)}")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=270.0, help="training wall time of every run")
    ap.add_argument("--out", default="runs/peer_trl")
    ap.add_argument("--trl-continuous-batching", action="store_true")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    out, summary = Path(args.out), {}
    for name in args.workloads.split(","):
        config, systems = WORKLOADS[name], SYSTEMS[name]
        runs = {who: [] for who in systems}
        for pair in range(args.pairs):
            order = systems[pair % len(systems) :] + systems[: pair % len(systems)]  # each leads in turn
            for who in order:
                where = out / name / f"{who}_{pair}"
                print(f"[{name}] pair {pair}: {who} ...", flush=True)
                if who == "trl":
                    result = run_trl(config, args.seconds, where, args.trl_continuous_batching)
                else:
                    result = run_hexrl(config, args.seconds, where, ("max_staleness=0",) if who == "hexrl-eta0" else ())
                runs[who].append(result)
                print(
                    f"[{name}] pair {pair}: {who} {result['steps']} steps, {result['tokens_per_s']:.0f} tokens/s, "
                    f"held-out {result['start_accuracy']:.3f} -> {result['end_accuracy']:.3f}",
                    flush=True,
                )
        summary[name] = runs
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_curves(summary, out / "peer_trl.png")
    print(f"\n{'workload':<8} {'who':<10} {'steps':>12} {'tokens/s':>16} {'held-out end':>16}  tokens/s over TRL's")
    for name, runs in summary.items():
        for who, rs in runs.items():
            steps = " / ".join(str(r["steps"]) for r in rs)
            rates = " / ".join(f"{r['tokens_per_s']:.0f}" for r in rs)
            accs = " / ".join(f"{100 * r['end_accuracy']:.1f}%" for r in rs)
            ratio = [r["tokens_per_s"] / t["tokens_per_s"] for r, t in zip(rs, runs["trl"])]
            ratios = " / ".join(f"{x:.2f}x" for x in ratio) if who != "trl" else ""
            print(f"{name:<8} {who:<10} {steps:>12} {rates:>16} {accs:>16}  {ratios}")


if __name__ == "__main__":
    main()
