"""The code's shape, checked: one direction of flow, no import cycle, verify independent of the code it
checks, header-only commands without torch, and every per-kind table covering every kind."""

from __future__ import annotations

import ast
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from mocli.kinds import KINDS, ModuleKind

ROOT = Path(__file__).resolve().parents[1] / "mocli"

# Lower layers first; a module may import its own layer and those below (README "Code layout").
LAYERS: list[list[str]] = [
    ["mocli", "mocli.errors", "mocli.progress", "mocli.trace", "mocli.findings", "mocli.tables", "mocli.io", "mocli.io.*",
     "mocli.ops", "mocli.ops.*", "mocli.parallel", "mocli.engine.dist", "mocli.targets.decode",
     "mocli.verify.quant", "mocli.verify.expect", "mocli.verify.html", "mocli.verify.junit"],
    ["mocli.formats", "mocli.devices", "mocli.procenv"],
    ["mocli.quant_config", "mocli.kinds"],
    ["mocli.checkpoint", "mocli.census", "mocli.exclusions", "mocli.scales", "mocli.deep_scan", "mocli.targets",
     "mocli.targets.*", "mocli.formats.*"],
    ["mocli.validate", "mocli.inspection", "mocli.engine", "mocli.engine.*", "mocli.loader"],
    ["mocli.plan", "mocli.plan.*", "mocli.verify", "mocli.verify.*", "mocli.serve", "mocli.serve.*"],
    ["mocli.convert", "mocli.repair", "mocli.quantize"],
    ["mocli.output", "mocli.render", "mocli.cli", "mocli.__main__", "mocli.vllm_plugin", "mocli.vllm_plugin.*"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """mocli modules imported anywhere in the file (functions too), except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    deps = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mocli"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                deps.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.startswith("mocli")}
    return {d for d in deps if d in modules}


def _layer(module: str) -> int:
    hits = [i for i, layer in enumerate(LAYERS) if any(fnmatchcase(module, pat) for pat in layer)]
    assert hits, f"{module} is in no layer of tests/test_architecture.py: place it"
    return hits[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_every_import_points_down_or_sideways(graph):
    up = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})" for m, deps in graph.items() for d in deps
          if not d.startswith(m + ".") and _layer(d) > _layer(m)]
    assert not up, "\n".join(up)


def test_no_import_cycle(graph):
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            if d.startswith(m + "."):  # a package re-exporting its own modules
                continue
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path[path.index(d):] + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_verify_shares_no_code_with_what_it_checks(graph):
    """verify decodes with its own inverses and tables: a wrong forward transform cannot cancel out."""
    shared = [f"{m} imports {d}" for m, deps in graph.items() if m.startswith("mocli.verify") for d in deps
              if d.startswith(("mocli.plan", "mocli.ops", "mocli.engine", "mocli.convert", "mocli.quantize"))]
    assert not shared, shared


def test_header_only_commands_never_import_torch():
    """Also verify's early digests: they exist to run while torch is being imported."""
    code = ("import sys; from mocli.cli import main\n"
            "import mocli.inspection, mocli.validate, mocli.checkpoint, mocli.render, mocli.formats.layout\n"
            "import mocli.verify.early\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr


def test_every_kind_table_covers_every_kind():
    """A new module kind fails here, at every table that lacks it: scheme, planner, loader class,
    verify check, threshold."""
    from mocli.loader import CLASSES
    from mocli.plan import PLANNERS
    from mocli.verify.common import THRESHOLDS
    from mocli.verify.dense import DENSE
    from mocli.verify.moe import MOE

    every = set(ModuleKind)
    tables = {"kinds.KINDS": KINDS, "plan.PLANNERS": PLANNERS, "loader.CLASSES": CLASSES,
              "verify THRESHOLDS": THRESHOLDS, "verify DENSE | MOE": {**DENSE, **MOE}}
    for name, table in tables.items():
        assert set(table) == every, f"{name} lacks {sorted(every - set(table))}"
    assert set(DENSE) == {k for k, s in KINDS.items() if not s.moe}
    assert set(MOE) == {k for k, s in KINDS.items() if s.moe}
    assert all(THRESHOLDS[k].gemm2 is not None for k in MOE)
