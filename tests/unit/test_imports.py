"""The project's modules import each other without cycles (function-level and TYPE_CHECKING imports count)."""

import ast
import subprocess
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]


PACKAGES = ("parallel", "cpu_bench", "planner")


def module_name(path: str) -> str:
    """Top-level modules and the packages' modules by their import names (a package's __init__ by the package's);
    exp/ and tests/ scripts put their own folder on sys.path, so they are imported by bare name."""
    p = Path(path).with_suffix("")
    if p.name == "__init__":
        p = p.parent
    return ".".join(p.parts) if p.parts[0] in PACKAGES else p.name


def import_graph() -> nx.DiGraph:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = files.stdout.split()
    names = {module_name(f): f for f in paths}
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    for name, path in names.items():
        for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t in names and t != name:
                    graph.add_edge(name, t)
    return graph


def test_no_import_cycles():
    graph = import_graph()
    assert {"train", "schedule", "buffer", "parallel.groups"} <= set(graph)  # the walk sees the tree
    assert graph.has_edge("train", "buffer") and graph.has_edge("cpu_bench", "cpu_bench.emulation")  # packages too
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles)


# The runtime (what torchrun starts) and the planner meet only at the plan JSON and at torch-free modules both read
# (parallel/sync_layout.py, plan.py): no runtime module reaches a planner module through its imports.
RUNTIME_TOP = {"train", "head", "rollout", "generator", "paged_forward", "kv_cache", "sampler", "model", "buffer"}
RUNTIME_TOP |= {"reward_math"}
RUNTIME_TOP |= {"config", "tasks", "runlog", "checkpoint", "errors", "plan"}
PLANNER_TOP = {"schedule", "cost_model", "device_profile", "simulate", "estimate_memory"}
PLANNER_PACKAGES = ("planner.",)
PLANNER_MODULES = {"cpu_bench.host"}  # the CPU bench's pricing of its host plugs into the planner


def runtime_modules(graph: nx.DiGraph) -> set[str]:
    return {n for n in graph if n in RUNTIME_TOP or n.startswith("parallel.")}


def planner_modules(graph: nx.DiGraph) -> set[str]:
    return {n for n in graph if n in PLANNER_TOP | PLANNER_MODULES or n.startswith(PLANNER_PACKAGES)}


def test_the_runtime_imports_no_planner_module():
    graph = import_graph()
    runtime, planner = runtime_modules(graph), planner_modules(graph)
    assert {"train", "rollout", "buffer", "parallel.trainer", "parallel.weight_sync"} <= runtime
    assert {"schedule"} <= planner
    # the walk sees both sides and the module they share
    assert graph.has_edge("parallel.weight_sync", "parallel.sync_layout")
    assert any(graph.has_edge(p, "parallel.sync_layout") for p in planner)
    reached = {(r, p) for r in runtime for p in nx.descendants(graph, r) & planner}
    assert not reached, "runtime modules reaching the planner: " + "; ".join(
        " -> ".join(nx.shortest_path(graph, r, p)) for r, p in sorted(reached)
    )
