"""Helpers of exp/real_model_cpu.sh: watch the ranks' memory during a run, then audit and summarise the run.

    python exp/real_model_report.py watch --pid <torchrun pid> --out <run>/rss.json     # until that pid exits
    python exp/real_model_report.py report <run> [--rss <run>/rss.json] [--check <check.json>] [--export <info.json>]

watch: every --interval seconds, each train.py process below the torchrun pid (the ranks; the math-verify scorer is
a separate interpreter and not counted) is read from /proc: VmHWM (the kernel's peak resident set) and VmRSS, keyed
by its RANK. The file is rewritten each time, so it holds the peaks up to the last sample before the exit.

report: the run audited by runlog.audit_run (exactly once, whole groups, version step - 1, no token older than eta,
no skipped step) and all train.total_steps done. Then the numbers: generated and
trained tokens/s over the steps' wall time, weight-sync seconds and bytes, peak RSS per role, and a summary block
for the README. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runlog import audit_run  # noqa: E402


# ---------------------------------------------------------------------------------------------- watch
def _proc_table() -> dict[int, int]:
    """pid -> ppid for every process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants(root: int, table: dict[int, int]) -> list[int]:
    children = defaultdict(list)
    for pid, ppid in table.items():
        children[ppid].append(pid)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rank_memory(pid: int) -> tuple[int, int, int] | None:
    """(RANK, VmHWM kB, VmRSS kB) of a train.py rank, else None."""
    try:
        if b"train.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        if b"RANK" not in env:
            return None  # the torchrun agent itself
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        return int(env[b"RANK"]), int(status["VmHWM"].split()[0]), int(status["VmRSS"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def watch(pid: int, out: Path, interval: float) -> int:
    peaks: dict[int, dict] = {}
    while os.path.exists(f"/proc/{pid}"):
        for child in _descendants(pid, _proc_table()):
            mem = _rank_memory(child)
            if mem is None:
                continue
            rank, hwm, rss = mem
            p = peaks.setdefault(rank, {"pid": child, "peak_rss_kb": 0, "max_sampled_rss_kb": 0})
            p["peak_rss_kb"] = max(p["peak_rss_kb"], hwm)
            p["max_sampled_rss_kb"] = max(p["max_sampled_rss_kb"], rss)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in sorted(peaks.items())}, indent=1))
        tmp.replace(out)
        time.sleep(interval)
    return 0


# ---------------------------------------------------------------------------------------------- report
def audit(run: Path) -> tuple[list[str], dict]:
    """runlog.audit_run, plus: the run reached its train.total_steps."""
    found = audit_run(run)
    problems = list(found["problems"])
    if found["steps"] != found["config"]["train"]["total_steps"]:
        problems.append(f"{found['steps']} steps, expected train.total_steps={found['config']['train']['total_steps']}")
    info = {
        "cfg": found["config"],
        "eta": found["eta"],
        "steps": found["step_lines"],
        "evals": found["eval_lines"],
        "trained": found["trajectories"] - found["dropped"],
        "dropped": found["dropped"],
        "groups": found["groups"],
        "lag_hist": found["lag_hist"],
    }
    return problems, info


def summarise(run: Path, info: dict, rss: dict | None, check: dict | None, export: dict | None) -> list[str]:
    steps, cfg = info["steps"], info["cfg"]
    wall = sum(m["step_s"] for m in steps)
    generated = sum(m["generated_tokens_per_s"] * m["step_s"] for m in steps)
    trained = sum(m["trained_tokens"] for m in steps)
    later = steps[1:] or steps  # step 1 also waits for the first rollouts of a cold start
    gen_later = sum(m["generated_tokens_per_s"] * m["step_s"] for m in later) / sum(m["step_s"] for m in later)
    train_later = sum(m["trained_tokens"] for m in later) / sum(m["step_s"] for m in later)
    sync = [m["weight_sync_s"] for m in steps]
    r, t = cfg["rollout"], cfg["train"]
    layout = json.loads((run / "layout.json").read_text()) if (run / "layout.json").exists() else []
    roles = {rec["rank"]: rec["role"] for rec in layout}
    n_roles = Counter(roles.values())
    lines = [f"run: {run}"]
    if export:
        lines.append(
            f"model: {Path(export['gguf']).name} -> {export['out']} ({export['dtype']}, "
            f"{export['bytes'] / 2**20:.0f} MiB, vocab {export['vocab_size']}, tied embeddings "
            f"{export['tied_embeddings']}, eos {export['eos'][0]}={export['eos'][1]}; reload = GGUF tensors: "
            f"max |diff| {export['max_abs_diff_vs_gguf']:g})"
        )
    if check:
        lines.append(
            f"generator vs HF (fp32, {check['gsm8k_prompts']} GSM8K prompts + {check['prompts'] - check['gsm8k_prompts']} "
            f"short one, <= {check['max_new_tokens']} tokens): greedy tokens "
            f"{'equal' if not check['failures'] else 'NOT equal'} to HF generate ({check['greedy_eos_stops']} ended on "
            f"EOS); max |log-prob - HF forward| "
            f"greedy {check['greedy_max_abs_logprob_diff']:.1e}, T=1 {check['sampled_T=1_max_abs_logprob_diff']:.1e}, "
            f"T=0.7/top-p/top-k {check['sampled_T=0.7,top_p=0.9,top_k=50_max_abs_logprob_diff']:.1e} "
            f"(tolerance {check['atol']:g}); greedy {check['ours_tokens_per_s']:.1f} tokens/s ours vs "
            f"{check['hf_tokens_per_s']:.1f} HF generate ({check['speed_ratio']:.2f}x)"
        )
    lines += [
        f"GRPO: {len(steps)} async steps, {t['prompts_per_step']} prompts x {r['samples_per_prompt']} samples, <= "
        f"{r['max_new_tokens']} new tokens, eta {info['eta']}, lr {t['lr']:g}, ranks {dict(n_roles)}; "
        f"{wall:.0f} s of steps (step 1 {steps[0]['step_s']:.0f} s, then {sum(m['step_s'] for m in later) / len(later):.1f} s "
        f"per step, train {sum(m['train_s'] for m in later) / len(later):.1f} s of it)",
        f"reward mean {sum(m['reward_mean'] for m in steps) / len(steps):.3f}, response length mean "
        f"{sum(m['response_len_mean'] for m in steps) / len(steps):.1f}, loss/grad_norm "
        f"{[round(m['loss'], 4) for m in steps]} / {[round(m['grad_norm'], 4) for m in steps]}, importance weight "
        f"max {max(m['importance_weight_max'] for m in steps):.4f}, held-out greedy "
        f"{[(e['step'], e['eval_accuracy']) for e in info['evals']]}",
        f"generated tokens/s: {generated / wall:.1f} over all steps, {gen_later:.1f} after step 1; trained "
        f"(response) tokens/s: {trained / wall:.1f}, {train_later:.1f} after step 1",
        f"weight sync: {sum(sync) / len(sync):.2f} s mean, {max(sync):.2f} s max per version "
        f"({steps[-1]['weight_sync_bytes'] / 2**20:.0f} MiB {steps[-1]['weight_sync_dtype']} sent per version)",
        f"staleness: max {max(m['staleness_max'] for m in steps)} <= eta {info['eta']}, token lag histogram "
        f"{info['lag_hist']}; rollout idle {steps[-1]['rollout_idle_frac']:.0%}, trainer idle "
        f"{steps[-1]['trainer_idle_frac']:.0%}",
        f"ledger: {info['trained']} trajectories in {info['groups']} groups, each consumed exactly once "
        f"({info['dropped']} dropped)",
    ]
    if rss:
        per_role = defaultdict(list)
        for rank, v in sorted(rss.items(), key=lambda kv: int(kv[0])):
            per_role[roles.get(int(rank), "?")].append(f"rank {rank} {v['peak_rss_kb'] / 2**20:.2f}")
        lines.append(
            "peak RSS (VmHWM, GiB): " + "; ".join(f"{role}: {', '.join(v)}" for role, v in sorted(per_role.items()))
        )
    else:
        lines.append("peak RSS: not measured (no --rss file)")
    return lines


def readme_row(info: dict, rss: dict | None, check: dict | None, run: Path) -> str:
    steps = info["steps"]
    wall = sum(m["step_s"] for m in steps)
    generated = sum(m["generated_tokens_per_s"] * m["step_s"] for m in steps)
    trained = sum(m["trained_tokens"] for m in steps)
    sync = sum(m["weight_sync_s"] for m in steps) / len(steps)
    layout = json.loads((run / "layout.json").read_text()) if (run / "layout.json").exists() else []
    roles = {rec["rank"]: rec["role"] for rec in layout}
    peak = defaultdict(float)
    for rank, v in (rss or {}).items():
        peak[roles.get(int(rank), "?")] = max(peak[roles.get(int(rank), "?")], v["peak_rss_kb"] / 2**20)
    gen = f"{check['ours_tokens_per_s']:.1f} vs HF {check['hf_tokens_per_s']:.1f}" if check else "--"
    mem = ", ".join(f"{k} {v:.2f}" for k, v in sorted(peak.items())) or "--"
    return (
        f"| SmolLM2-135M-Instruct (fp32), {len(steps)} GRPO steps, η {info['eta']} | {gen} | {generated / wall:.1f} | "
        f"{trained / wall:.1f} | {sync:.2f} | {mem} | max {max(m['staleness_max'] for m in steps)}, exactly-once |"
    )


def report(args) -> int:
    run = Path(args.run)
    problems, info = audit(run)
    load = lambda p: json.loads(Path(p).read_text()) if p and Path(p).exists() else None  # noqa: E731
    rss, check, export = load(args.rss), load(args.check), load(args.export)
    for line in summarise(run, info, rss, check, export):
        print(line)
    print("README row: | model, run | greedy tokens/s ours vs HF (1 thread) | generated tokens/s | trained tokens/s |")
    print("            | weight sync s | peak RSS GiB per role | staleness, ledger |")
    print(readme_row(info, rss, check, run))
    if check and check.get("failures"):
        problems += [f"generator check: {f}" for f in check["failures"]]
    for p in problems:
        print(f"FAIL {p}")
    print("audit: " + ("FAILED" if problems else f"ok (staleness <= eta {info['eta']}, ledger exactly-once)"))
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--interval", type=float, default=0.5)
    r = sub.add_parser("report")
    r.add_argument("run")
    r.add_argument("--rss")
    r.add_argument("--check", help="the JSON record of exp/check_real_model.py")
    r.add_argument("--export", help="export_info.json of exp/export_gguf_model.py")
    args = ap.parse_args()
    if args.cmd == "watch":
        return watch(args.pid, args.out, args.interval)
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
