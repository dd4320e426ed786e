"""Compare hexrl runs: a summary table and PNG plots, from local run directories or from W&B.

    python exp/compare.py runs/sweep                                  # every run dir under a sweep dir
    python exp/compare.py runs/a runs/b --group-by staleness.max_staleness --out /tmp/cmp
    python exp/compare.py --wandb my-entity/hexrl --filter '{"config.staleness.max_staleness": 4}'

A run directory holds metrics.jsonl (lines with "loss" are optimizer steps, lines with "eval_accuracy" are
greedy held-out evaluations; runlog.py), config.yaml (the resolved config) and, optionally, ledger.jsonl
(one line per consumed trajectory, used for the staleness distribution). W&B runs carry the same records in
their history and the same config tree, so both sources become the same `Run` below.

Table columns (steps after the first `--warmup` are the steady state; step 1 also pays the pipeline fill):
  final/best acc   last / best greedy eval accuracy        tok/s, gen tok/s   Σ trained (= response, loss-carrying)
                                                           or generated tokens / Σ step_s
  step s           mean step time                          stale mean/max     token-level lag (versions) of trained tokens
  roll/train idle  idle fractions at the end of the run    sync s             mean weight sync seconds per step
With --group-by, runs are grouped by that config key; "× first" is tok/s relative to the first group.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class CompareError(ValueError):
    pass


@dataclass
class Run:
    name: str
    config: dict  # nested, as in config.yaml
    steps: list[dict]  # step records, in step order
    evals: list[dict]  # {"step", "time", "eval_accuracy", ...}
    staleness: list[int] | None = None  # per consumed trajectory: trainer version - oldest token version
    source: str = ""
    summary: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- loading
def split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Step records have "loss", eval records "eval_accuracy" (a W&B history row may have both)."""
    steps = sorted((r for r in records if r.get("loss") is not None), key=lambda r: r["step"])
    evals = sorted(
        (r for r in records if r.get("eval_accuracy") is not None), key=lambda r: (r["step"], r.get("time", 0))
    )
    return steps, evals


def read_jsonl(path: Path) -> list[dict]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CompareError(f"{path}:{i}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise CompareError(f"{path}:{i}: expected a JSON object, got {type(rec).__name__}")
            out.append(rec)
    return out


def load_run_dir(path: Path) -> Run:
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise CompareError(f"{path} is not a run directory (no metrics.jsonl)")
    records = read_jsonl(metrics)
    for i, r in enumerate(records, 1):
        if "step" not in r:
            raise CompareError(f"{metrics}:{i}: record has no 'step'")
    steps, evals = split_records(records)
    config = {}
    if (path / "config.yaml").is_file():
        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
        if not isinstance(config, dict):
            raise CompareError(f"{path / 'config.yaml'}: top level must be a mapping")
    staleness = None
    if (path / "ledger.jsonl").is_file():
        staleness = [r["trainer_version"] - r["min_version"] for r in read_jsonl(path / "ledger.jsonl")]
    return Run(path.name, config, steps, evals, staleness, source=str(path))


def find_run_dirs(paths: list[str]) -> list[Path]:
    """Each path is a run directory or a directory holding run directories (at any depth)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise CompareError(f"{p} does not exist")
        if (p / "metrics.jsonl").is_file():
            found.append(p)
            continue
        under = sorted(m.parent for m in p.rglob("metrics.jsonl"))
        if not under:
            raise CompareError(f"{p} holds no run directories (no metrics.jsonl at any depth)")
        found.extend(under)
    return list(dict.fromkeys(found))


def load_wandb_runs(path: str, filters: dict | None = None, api=None) -> list[Run]:
    """Runs of an `entity/project` through W&B's public API (`api` is injectable for tests)."""
    if api is None:
        import wandb

        api = wandb.Api()
    runs = []
    for wr in api.runs(path, filters=filters or {}):
        rows = []
        for row in wr.scan_history():
            # the trainer step is the logged `trainer_step` (runs before it existed used W&B's own _step)
            step = row.get("trainer_step", row.get("_step"))
            row = {k: v for k, v in row.items() if not k.startswith("_") and k != "trainer_step"}
            row.setdefault("step", step)
            if row["step"] is not None:
                rows.append(row)
        steps, evals = split_records(rows)
        config = {k: v for k, v in dict(wr.config).items() if not k.startswith("_")}
        runs.append(Run(wr.name, config, steps, evals, None, source=f"wandb:{path}/{getattr(wr, 'id', wr.name)}"))
    if not runs:
        raise CompareError(f"W&B project {path} has no runs matching {filters or {}}")
    return runs


def unique_names(runs: list[Run]) -> None:
    """Runs from different sweeps may share a directory name (eta4): prefix the parent directory."""
    counts = Counter(r.name for r in runs)
    for r in runs:
        if counts[r.name] > 1 and not r.source.startswith("wandb:"):
            r.name = f"{Path(r.source).parent.name}/{r.name}"


def config_value(config: dict, key: str):
    """`staleness.max_staleness` -> config["staleness"]["max_staleness"]."""
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# ---------------------------------------------------------------------------------------------- summary
def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def summarize(run: Run, warmup: int = 1) -> dict:
    """The table row of one run; NaN where the run has no data for a column."""
    steady = run.steps[warmup:] if len(run.steps) > warmup else run.steps
    total_s = sum(r.get("step_s", 0.0) for r in steady)
    accs = [e["eval_accuracy"] for e in run.evals]
    last = run.steps[-1] if run.steps else {}
    nan = math.nan
    s = {
        "steps": len(run.steps),
        "final_acc": accs[-1] if accs else nan,
        "best_acc": max(accs) if accs else nan,
        "tokens_per_s": _ratio(sum(r.get("trained_tokens", 0.0) for r in steady), total_s),
        "gen_tokens_per_s": _ratio(
            sum(r.get("generated_tokens_per_s", 0.0) * r.get("step_s", 0.0) for r in steady), total_s
        ),
        "step_s": _ratio(total_s, len(steady)),
        "staleness_mean": _ratio(sum(r.get("staleness_mean", 0.0) for r in run.steps), len(run.steps)),
        "staleness_max": max((r.get("staleness_max", 0) for r in run.steps), default=nan),
        "rollout_idle": last.get("rollout_idle_frac", nan),
        "trainer_idle": last.get("trainer_idle_frac", nan),
        "sync_s": _ratio(sum(r.get("weight_sync_s", 0.0) for r in run.steps), len(run.steps)),
        "wall_s": last.get("elapsed_s", nan),
    }
    run.summary = s
    return s


COLUMNS = [
    ("steps", "steps", "{:d}"),
    ("final_acc", "final acc", "{:.3f}"),
    ("best_acc", "best acc", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("gen_tokens_per_s", "gen tok/s", "{:.1f}"),
    ("step_s", "step s", "{:.3f}"),
    ("staleness_mean", "stale mean", "{:.2f}"),
    ("staleness_max", "stale max", "{:d}"),
    ("rollout_idle", "roll idle", "{:.2f}"),
    ("trainer_idle", "train idle", "{:.2f}"),
    ("sync_s", "sync s", "{:.4f}"),
    ("wall_s", "wall s", "{:.1f}"),
]


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec == "{:d}":
        return str(int(round(value)))
    return spec.format(value)


def _sort_key(value):
    """Numbers in numeric order, then everything else as text; None last."""
    if isinstance(value, bool) or value is None:
        return (2, str(value))
    if isinstance(value, (int, float)):
        return (0, value)
    return (1, str(value))


def group_runs(runs: list[Run], key: str | None) -> dict:
    """Group value -> runs, in sorted group order (one group named by run when ungrouped)."""
    if key is None:
        return {i: [r] for i, r in enumerate(runs)}
    missing = [r.name for r in runs if config_value(r.config, key) is None]
    if missing:
        raise CompareError(f"--group-by '{key}' is not in the config of run(s) {', '.join(missing)}")
    groups: dict = {}
    for r in runs:
        groups.setdefault(config_value(r.config, key), []).append(r)
    return {k: groups[k] for k in sorted(groups, key=_sort_key)}


def group_means(runs: list[Run]) -> dict:
    """Column-wise mean over a group's runs (NaNs ignored; staleness max is the max)."""
    out = {}
    for col, _, _ in COLUMNS:
        vals = [r.summary[col] for r in runs if not (isinstance(r.summary[col], float) and math.isnan(r.summary[col]))]
        if col == "staleness_max":
            out[col] = max(vals, default=math.nan)
        else:
            out[col] = sum(vals) / len(vals) if vals else math.nan
    return out


def format_table(runs: list[Run], group_by: str | None = None) -> str:
    groups = group_runs(runs, group_by)
    head = (
        ["run"] + ([group_by, "n"] if group_by else []) + [h for _, h, _ in COLUMNS] + (["x first"] if group_by else [])
    )
    rows = []
    if group_by:
        base = None
        for value, members in groups.items():
            m = group_means(members)
            base = m["tokens_per_s"] if base is None else base
            rows.append(
                [",".join(r.name for r in members), str(value), str(len(members))]
                + [_fmt(m[c], spec) for c, _, spec in COLUMNS]
                + [_fmt(_ratio(m["tokens_per_s"], base), "{:.2f}")]
            )
    else:
        for r in runs:
            rows.append([r.name] + [_fmt(r.summary[c], spec) for c, _, spec in COLUMNS])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


# ---------------------------------------------------------------------------------------------- plots
def _label(run: Run, group_by: str | None) -> str:
    return f"{group_by.rsplit('.', 1)[-1]}={config_value(run.config, group_by)} ({run.name})" if group_by else run.name


def make_plots(runs: list[Run], out_dir: Path, group_by: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = [r for members in group_runs(runs, group_by).values() for r in members]
    colors = {r.name: plt.cm.viridis(i / max(len(ordered) - 1, 1)) for i, r in enumerate(ordered)}
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # reward and eval accuracy, against wall time and against optimizer step
    for xkey, xlabel, name in [
        ("time", "wall time since run start (s)", "reward_vs_time.png"),
        ("step", "optimizer step", "reward_vs_step.png"),
    ]:
        fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in ordered:
            c, lab = colors[r.name], _label(r, group_by)
            ax_r.plot(
                [s.get(xkey, math.nan) for s in r.steps],
                [s.get("reward_mean", math.nan) for s in r.steps],
                "-",
                color=c,
                label=lab,
            )
            ax_a.plot(
                [e.get(xkey, math.nan) for e in r.evals],
                [e["eval_accuracy"] for e in r.evals],
                "o-",
                color=c,
                label=lab,
            )
        ax_r.set(
            xlabel=xlabel, ylabel="mean reward of trained samples", title=f"Training reward vs {xlabel.split(' (')[0]}"
        )
        ax_a.set(
            xlabel=xlabel,
            ylabel="greedy held-out accuracy (fraction)",
            title=f"Eval accuracy vs {xlabel.split(' (')[0]}",
        )
        for ax in (ax_r, ax_a):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, name)

    # throughput: per step, and the steady-state summary
    fig, (ax_s, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ordered:
        ax_s.plot(
            [s["step"] for s in r.steps],
            [s.get("trained_tokens_per_s", math.nan) for s in r.steps],
            "-",
            color=colors[r.name],
            label=_label(r, group_by),
        )
    ax_s.set(xlabel="optimizer step", ylabel="trained tokens/s", title="Training throughput per step")
    ax_s.grid(alpha=0.3)
    ax_s.legend(fontsize=7)
    names = [_label(r, group_by) for r in ordered]
    ax_b.bar(
        range(len(ordered)),
        [r.summary["tokens_per_s"] for r in ordered],
        color=[colors[r.name] for r in ordered],
        label="trained",
    )
    ax_b.plot(range(len(ordered)), [r.summary["gen_tokens_per_s"] for r in ordered], "kD", label="generated")
    ax_b.set_xticks(range(len(ordered)), names, rotation=30, ha="right", fontsize=7)
    ax_b.set(ylabel="tokens/s (steady state)", title="Steady-state throughput per run")
    ax_b.legend(fontsize=7)
    save(fig, "throughput.png")

    # staleness distribution: the ledger's per-trajectory lag, or per-step max lag when no ledger (W&B)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(len(ordered), 1)
    seen: set[int] = set()
    for i, r in enumerate(ordered):
        values = r.staleness if r.staleness is not None else [int(s.get("staleness_max", 0)) for s in r.steps]
        counts = Counter(values)
        total = max(sum(counts.values()), 1)
        xs = sorted(counts)
        seen.update(xs)
        src = "" if r.staleness is not None else " [per-step max]"
        ax.bar(
            [x + (i - (len(ordered) - 1) / 2) * width for x in xs],
            [counts[x] / total for x in xs],
            width,
            color=colors[r.name],
            label=_label(r, group_by) + src,
        )
    ax.set_xticks(sorted(seen))
    ax.set(
        xlabel="staleness: trainer version - oldest token version (versions)",
        ylabel="fraction of trained trajectories",
        title="Staleness distribution",
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    save(fig, "staleness.png")
    return written


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compare hexrl runs: summary table + PNG plots.")
    ap.add_argument("paths", nargs="*", help="run directories and/or sweep directories holding run directories")
    ap.add_argument("--wandb", default="", help="entity/project: read runs through the W&B public API instead")
    ap.add_argument("--filter", default="", help="W&B filter as JSON (MongoDB-style, as wandb.Api().runs takes)")
    ap.add_argument("--group-by", default=None, help="config key, e.g. staleness.max_staleness")
    ap.add_argument("--warmup", type=int, default=1, help="leading steps left out of throughput and step time")
    ap.add_argument(
        "--out",
        default=None,
        help="directory for the PNGs and summary.json (default: <sweep>/compare for one sweep dir, else runs/compare)",
    )
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    try:
        if bool(a.paths) == bool(a.wandb):
            raise CompareError("give run/sweep directories or --wandb entity/project (exactly one of them)")
        if a.warmup < 0:
            raise CompareError(f"--warmup must be >= 0, got {a.warmup}")
        if a.wandb:
            try:
                filters = json.loads(a.filter) if a.filter else None
            except json.JSONDecodeError as e:
                raise CompareError(f"--filter is not JSON ({e.msg})") from None
            runs = load_wandb_runs(a.wandb, filters)
        else:
            runs = [load_run_dir(p) for p in find_run_dirs(a.paths)]
            unique_names(runs)
        for r in runs:
            summarize(r, a.warmup)
        table = format_table(runs, a.group_by)
        print(table)
        single_sweep = len(a.paths) == 1 and not (Path(a.paths[0]) / "metrics.jsonl").is_file()
        out = Path(a.out) if a.out else (Path(a.paths[0]) / "compare" if single_sweep else Path("runs/compare"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(
            json.dumps(
                {
                    r.name: {
                        "source": r.source,
                        "group": config_value(r.config, a.group_by) if a.group_by else None,
                        **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.summary.items()},
                    }
                    for r in runs
                },
                indent=1,
            )
        )
        (out / "table.md").write_text(table + "\n")
        if not a.no_plots:
            for p in make_plots(runs, out, a.group_by):
                print(f"wrote {p}")
        print(f"wrote {out / 'summary.json'}")
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
