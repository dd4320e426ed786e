"""A recorded run's own split priced by the cost model with a device profile: does the planner predict its step?

    python exp/check_profile_prediction.py runs/<run> --profile exp/profiles/cpu.yaml [--cluster exp/clusters/cpu.yaml]

Prices the run's own split -- its train layout (dp x tp x pp) and rollout replicas, from <run>/plan.json and
<run>/layout.json -- with the cost model (search.Planner.evaluate) on the cluster YAML resized to the run's world
size, the profile applied (profile_fit.apply_profile), and the workload of the run's config.yaml:
  prompts_per_step, samples_per_prompt, max_staleness (eta), ppo_minibatches, micro_batch_tokens, max_batch_size,
  interrupt_mode (whether a weight update re-prefills the running sequences),
  the weight-sync dtype (precision), and train_passes as the trainer runs them: 3 (forward + backward) when it reads
  pi_prox off the training forward (ppo_minibatches 1, or no recompute), 4 with the recompute, +1 for a KL reference;
  the prompt length: the mean token count of the task's training prompts (the tokenizer of model.path; --prompt-len
  to give it); the output length: the run's mean response length (metrics.jsonl's response_len_mean) and, where the
  run logged them, its steps' mean p50 / p90 / max (specs.Workload.from_quantiles), a workload input like the paper's
  profiled output distribution P, not a timing.
Nothing timed in the run goes into the prediction; its timings are only compared with it:
  step     the median step_s of the steady-state steps: the first --skip steps and every step after an evaluation
           (train.py waits for the eval there; the cost model has no evaluations) left out; the mean over all steps
           (elapsed / steps) is shown beside it
  train    the median train_s (the batch broadcast and Trainer.train_step) of the same steps
  sync     the median weight_sync_s of the same steps (the head's sends), and where the run logged it the median
           weight_ready_s (until the last replica acknowledged the version: what an eta = 0 step waits for)
  rollout  the rollout ranks' busy time per step, (1 - rollout_idle_frac) x the mean step, for information: it
           includes the evaluations, which the cost model does not price
Exit status 0 when the predicted step is within --tolerance (default 15%) of the measured one, 1 when not.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from planner import profile_fit, search, specs

ROOT = Path(__file__).resolve().parents[1]

PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def read_run(run: Path) -> tuple[dict, list[dict], dict, list[dict]]:
    """(config, metrics rows, plan.json, layout.json) of a run directory."""
    need = [run / n for n in ("config.yaml", "metrics.jsonl", "plan.json", "layout.json")]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        raise SystemExit(f"error: {run} is not a finished train.py run (missing {', '.join(missing)})")
    cfg = yaml.safe_load(need[0].read_text())
    rows = [json.loads(line) for line in need[1].read_text().splitlines() if line.strip()]
    return cfg, rows, json.loads(need[2].read_text()), json.loads(need[3].read_text())


def train_passes(train: dict) -> float:
    """Forward-pass equivalents per trained token, as parallel/trainer.py runs them."""
    k = int(train.get("ppo_minibatches", 1))
    recompute = bool(train.get("recompute_prox_logprobs", True))
    passes = 3.0 + (1.0 if recompute and k > 1 else 0.0)
    return passes + (1.0 if float(train.get("kl_coef", 0.0)) > 0 else 0.0)


def mean_prompt_tokens(cfg: dict, limit: int = 2000) -> float:
    """The mean token count of the task's training prompts, tokenized as the rollout ranks do."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from tasks import load_task

    data = SimpleNamespace(**{"on_bad_row": "skip", **cfg["data"]})
    tok = AutoTokenizer.from_pretrained(str(ROOT / cfg["model"]["path"]))
    train, _ = load_task(data, tok)
    return statistics.fmean(len(tok(row["prompt"])["input_ids"]) for row in train[:limit])


def steady_steps(rows: list[dict], skip: int) -> list[dict]:
    """Training steps without the first `skip` and without those that followed an evaluation."""
    evals = {r["step"] for r in rows if "eval_accuracy" in r}
    steps = [r for r in rows if "step_s" in r]
    return [r for r in steps[skip:] if r["step"] - 1 not in evals]


def workload(cfg: dict, rows: list[dict], prompt_len: float) -> specs.Workload:
    steps = [r for r in rows if "step_s" in r]
    dtype = next((r["weight_sync_dtype"] for r in steps if "weight_sync_dtype" in r), "float32")
    gen_mean = statistics.fmean(r["response_len_mean"] for r in steps)
    # the length distribution from the steps' quantiles where the run logged them (an eta = 0 step waits for its
    # longest sequence), else the mean alone
    keys = {0.5: "response_len_p50", 0.9: "response_len_p90", 1.0: "response_len_max"}
    quantiles = {q: statistics.fmean(r[k] for r in steps) for q, k in keys.items() if all(k in r for r in steps)}
    return specs.Workload.from_quantiles(
        gen_mean,
        quantiles if len(quantiles) == len(keys) else None,
        prompts_per_step=int(cfg["train"]["prompts_per_step"]),
        samples_per_prompt=int(cfg["rollout"]["samples_per_prompt"]),
        prompt_len=prompt_len,
        eta=int(cfg["staleness"]["max_staleness"]),
        precision=PRECISION.get(dtype, "fp32"),
        ppo_minibatches=int(cfg["train"]["ppo_minibatches"]),
        microbatch_tokens=int(cfg["train"]["micro_batch_tokens"]),
        max_batch=int(cfg["rollout"]["max_batch_size"]),
        train_passes=train_passes(cfg["train"]),
        kv_recompute=cfg["rollout"].get("interrupt_mode", "recompute") == "recompute",
    )


def predict(
    cluster_path: str, profiles: list[str], cfg: dict, plan: dict, layout: list[dict], wl: specs.Workload
) -> tuple[search.Evaluation, search.Planner]:
    """The cost model's evaluation of the run's own split (its train layout and rollout replicas), and the planner
    that priced it (its cluster: the YAML resized to the run, the profile applied)."""
    cluster = specs.load_cluster(cluster_path, plan["world_size"] if plan["world_size"] >= 2 else None)
    eff = specs.Efficiency()
    for path in profiles:
        eff = profile_fit.apply_profile(eff, cluster, profile_fit.load_profile(path), path)
    t = plan["train"]
    replicas: dict[int, int] = {}
    for r in layout:
        if r["role"] == "rollout" and r.get("replica") is not None:
            replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    rollout_tp = max(replicas.values()) if replicas else None
    p = search.Planner(
        cluster,
        specs.load_model_spec(ROOT / cfg["model"]["path"]),
        wl,
        eff,
        forced_layout=(t["dp"], t["tp"], t["pp"]),
        rollout_tp=rollout_tp,
        weight_bucket_mb=float(cfg.get("dist", {}).get("weight_bucket_mb", 64.0)),
    )
    counts = [0] * len(cluster.machines)
    for r in layout:
        if r["role"] == "train":
            counts[int(r.get("node") or 0) if len(cluster.machines) > 1 else 0] += 1
    ev = p.evaluate(tuple(counts))
    if not ev.train or not ev.rollout:
        raise SystemExit(f"error: the cost model finds no plan for the run's split {counts} on {cluster.name}")
    return ev, p
