"""The project's modules import each other without cycles (function-level and TYPE_CHECKING imports count)."""

import ast
import subprocess
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: str) -> str:
    """Top-level and parallel/ modules by their import names; exp/ and tests/ scripts put their own folder on
    sys.path, so they are imported by bare name."""
    p = Path(path).with_suffix("")
    return ".".join(p.parts) if p.parts[0] in ("parallel", "cpu_bench", "planner") else p.name


def import_graph() -> nx.DiGraph:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [f for f in files.stdout.split() if not Path(f).name == "__init__.py"]
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
    assert graph.has_edge("train", "buffer")
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles)
