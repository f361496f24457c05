"""The code's shape, checked: one direction of flow, no import cycle, verify independent of the code it
checks, header-only commands without torch, and every module kind one card that the per-kind tables
derive from."""

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
     "mocli.ops", "mocli.ops.*", "mocli.workers", "mocli.worker_loop", "mocli.procenv", "mocli.parallel", "mocli.stream.dist", "mocli.targets.decode",
     "mocli.numerics", "mocli.numerics.*", "mocli.verify.expect", "mocli.verify.html", "mocli.verify.junit"],
    ["mocli.formats", "mocli.devices"],
    ["mocli.quant_config", "mocli.schemes", "mocli.schemes.*", "mocli.kinds", "mocli.module_classes"],
    ["mocli.checkpoint", "mocli.compressed_tensors", "mocli.quark", "mocli.gpt_oss", "mocli.ct_schemes", "mocli.ct_patterns", "mocli.census", "mocli.exclusions", "mocli.engines", "mocli.engines.*", "mocli.scales", "mocli.deep_scan", "mocli.targets",
     "mocli.targets.*", "mocli.formats.*"],
    ["mocli.inspection", "mocli.stream", "mocli.stream.*", "mocli.loader"],
    # validate --target plans the conversion to judge the scales it computes (SCL006): beside the planner
    ["mocli.plan", "mocli.plan.*", "mocli.validate", "mocli.validate.*", "mocli.verify", "mocli.verify.*", "mocli.serve",
     "mocli.serve.*"],
    ["mocli.convert", "mocli.repair", "mocli.quantize"],
    ["mocli.output", "mocli.render", "mocli.cli", "mocli.cli.*", "mocli.__main__", "mocli.vllm_plugin", "mocli.vllm_plugin.*"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """mocli modules imported anywhere in the file (functions too), except under ``if TYPE_CHECKING``
    unless ``type_checking``."""
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
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


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
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


def test_no_import_cycle(graph):
    _assert_acyclic(graph)


def test_no_import_cycle_even_for_type_checking():
    """Nor through ``if TYPE_CHECKING`` imports: two modules that need each other's types share a third
    (``stream.unit_runner`` takes what it needs of a job, not the ``Job``)."""
    modules = _modules()
    _assert_acyclic({m: _imports(p, modules, type_checking=True) - {m} for m, p in modules.items()})


def _folder(module: str, modules: dict[str, Path]) -> str:
    """A module's folder: its subpackage (``mocli.verify``), or itself for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or modules[module].name == "__init__.py" else module


def test_no_import_cycle_between_folders(graph):
    """Folders as units (a subpackage, or a top-level module): imports between them form no cycle,
    function-level imports counted."""
    modules = _modules()
    folders: dict[str, set[str]] = {}
    for m, deps in graph.items():
        folders.setdefault(_folder(m, modules), set()).update(_folder(d, modules) for d in deps)
    for f in folders:
        folders[f].discard(f)
    state: dict[str, int] = {}

    def visit(f: str, path: list[str]) -> None:
        state[f] = 1
        for d in sorted(folders.get(f, ())):
            assert state.get(d) != 1, "folder import cycle: " + " -> ".join(path[path.index(d):] + [f, d])
            if d not in state:
                visit(d, path + [f])
        state[f] = 2

    for f in sorted(folders):
        if f not in state:
            visit(f, [])


def test_no_two_top_level_classes_share_a_name():
    """A class name says which one it is anywhere in mocli: the stored-tensor dataclasses
    (``module_classes``), their verify checks (``...Check``), ``devices.Device`` and serving's ``Hardware``."""
    seen: dict[str, list[str]] = {}
    for p in sorted(ROOT.rglob("*.py")):
        for n in ast.parse(p.read_text()).body:
            if isinstance(n, ast.ClassDef):
                seen.setdefault(n.name, []).append(f"{p.relative_to(ROOT.parent)}:{n.lineno}")
    twice = {name: where for name, where in seen.items() if len(where) > 1}
    assert not twice, twice


def test_serving_stands_on_no_part_of_verify(graph):
    """The runtime (``mocli.serve``) and the checker share number formats through ``mocli.numerics``."""
    wrong = [f"{m} imports {d}" for m, deps in graph.items() if m.startswith("mocli.serve") for d in deps
             if d.startswith("mocli.verify")]
    assert not wrong, wrong


def _callers_of_manifest_json(monkeypatch) -> list[str]:
    """Record the mocli module that turns ``mocli-layout.json``'s bytes into a dict, each time (``json.loads``
    or ``orjson.loads`` is what every JSON reader ends in: ``io.jsonfile``, ``json.load``)."""
    import inspect
    import json

    import orjson

    callers: list[str] = []

    def recording(loads):
        def parse(*args, **kwargs):
            data = loads(*args, **kwargs)
            if isinstance(data, dict) and data.get("format") == "mocli-layout":
                frames = [f.filename for f in inspect.stack()[1:]]
                callers.append(next((f for f in frames if f.startswith(f"{ROOT}/") and not f.endswith("/io/jsonfile.py")),
                                    "?"))
            return data
        return parse

    monkeypatch.setattr(json, "loads", recording(json.loads))
    monkeypatch.setattr(orjson, "loads", recording(orjson.loads))
    return callers


def _dicts_reachable(value, seen: set[int]):
    """Every dict reachable from ``value`` through dataclass fields, dicts, lists and tuples."""
    import dataclasses

    if id(value) in seen:
        return
    seen.add(id(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _dicts_reachable(getattr(value, f.name), seen)
    elif isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _dicts_reachable(v, seen)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _dicts_reachable(v, seen)


def _manifest_names_outside_formats() -> tuple[list[str], list[str]]:
    """Outside ``mocli/formats/``: where ``manifest_json`` is named, and each subscript or ``.get`` on a
    name or attribute called ``*manifest*``."""
    named, indexed = [], []
    for p in sorted(ROOT.rglob("*.py")):
        if "formats" in p.relative_to(ROOT).parts:
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
            if name == "manifest_json" or isinstance(n, ast.alias) and n.name == "manifest_json":
                named.append(f"{p.relative_to(ROOT.parent)}:{getattr(n, 'lineno', '?')}")
            target = n.value if isinstance(n, ast.Subscript) else (
                n.func.value if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                else None)
            label = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
            if "manifest" in label.lower():
                indexed.append(f"{p.relative_to(ROOT.parent)}:{n.lineno}: {ast.unparse(n)}")
    return named, indexed


def test_the_manifest_is_a_dict_only_inside_formats(cli, tmp_path, monkeypatch):
    """The manifest is a dict only inside ``mocli.formats``: everything else holds the typed, checked
    ``Layout`` (``formats.manifest``), so there is no dict to index and a misspelt field is an
    AttributeError, not a silent None. A rule on what a variable is called could be dodged by renaming
    it; this one is on where a manifest dict can come from and what a ``Layout`` lets one reach:

    1. read: converting, verifying and loading a real output, every parse of the manifest's bytes into a
       dict happens in a module of ``mocli/formats/`` (traced at ``json.loads``, whatever the variable);
    2. held: nothing reachable from a read ``Layout`` or an opened rank (``ConvertedCheckpoint``: its fields,
       and theirs) is a dict of the manifest, of a rank's section (one with ``format: mocli-layout``, or with
       ``modules`` and ``tensors``) or of a module entry (``kind``, ``tensors`` and ``meta``): verify, the
       loader and the plugin's kernels read a module as a ``ModuleEntry``;
    3. written: ``manifest_json`` (the one serialiser) is named nowhere outside ``mocli/formats/``;
    and, what issue 45 counted, no subscript or ``.get`` on a name or attribute called ``*manifest*``
    outside ``mocli/formats/`` (the plugin, which needs vLLM, is held by 3 and this)."""
    from mocli.formats.layout import read_layout
    from mocli.formats.manifest import ModuleEntry
    from mocli.loader import load_converted
    from tests.conftest import REAL_QWEN

    callers = _callers_of_manifest_json(monkeypatch)
    out = tmp_path / "o"
    assert cli("-q", "convert", REAL_QWEN, "-o", out, "--target", "flashinfer-trtllm", "--tp", "2").exit_code == 0
    assert cli("-q", "verify", out, "--layers", "*.0.mlp.experts").exit_code == 0
    ck = load_converted(out, rank=1, modules=[])
    layout = read_layout(out)
    assert ck.module_names and all(isinstance(ck.module_entry(n), ModuleEntry) for n in ck.module_names)
    outside = [c for c in callers if not c.startswith(f"{ROOT / 'formats'}/")]
    assert callers and not outside, outside

    raw = [sorted(d)[:6] for d in _dicts_reachable((layout, ck), set())
           if d.get("format") == "mocli-layout" or {"modules", "tensors"} <= set(d) or {"kind", "tensors", "meta"} <= set(d)]
    assert not raw, raw

    named, indexed = _manifest_names_outside_formats()
    assert not named, named
    assert not indexed, indexed


def test_stored_schemes_are_asked_not_branched_on():
    """``Algo.`` (a configured algorithm) is named outside ``mocli.schemes`` and the config parsers
    (``quant_config``, ``compressed_tensors`` and its ``ct_schemes``, ``quark``, ``gpt_oss``: they map a file's words to
    algorithms) at most
    a few times: the rest of mocli asks a module's scheme (``mocli.schemes``) what differs."""
    import re

    refs = [f"{p.relative_to(ROOT.parent)}:{i}" for p in ROOT.rglob("*.py")
            if "schemes" not in p.parts and p.name not in ("quant_config.py", "compressed_tensors.py", "ct_schemes.py",
                                                                     "quark.py", "gpt_oss.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bAlgo\.", line)]
    assert len(refs) <= 5, refs


def test_the_e4m3_maximum_is_defined_twice_at_most():
    """Once for the converter (``mocli.ops.fp8``), once for verify and serving (``mocli.numerics``): kept
    apart on purpose, so that an encoder cannot pass its own check; nowhere else as a number."""
    defs = [f"{p.relative_to(ROOT.parent)}:{n.lineno}" for p in ROOT.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Constant) and type(n.value) in (int, float) and n.value == 448]
    assert sorted(d.rpartition(":")[0] for d in defs) == ["mocli/numerics/__init__.py", "mocli/ops/fp8.py"], defs


def test_modules_and_functions_stay_small():
    """No module over 500 lines; at most five functions over 60 (DEVELOPERS.md)."""
    big, long = [], []
    for p in ROOT.rglob("*.py"):
        src = p.read_text()
        if len(src.splitlines()) > 500:
            big.append(str(p.relative_to(ROOT.parent)))
        long += [f"{p.relative_to(ROOT.parent)}:{f.name}" for f in ast.walk(ast.parse(src))
                 if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.end_lineno - f.lineno + 1 > 60]
    assert not big, big
    assert len(long) <= 5, long


def test_verify_shares_no_code_with_what_it_checks(graph):
    """verify decodes with its own inverses and tables: a wrong forward transform cannot cancel out. It
    reads the stored schemes (``mocli.schemes``) as data, never the converter's, repair's or the serving
    kernels' code."""
    shared = [f"{m} imports {d}" for m, deps in graph.items() if m.startswith("mocli.verify") for d in deps
              if d.startswith(("mocli.plan", "mocli.ops", "mocli.stream", "mocli.convert", "mocli.quantize",
                               "mocli.repair", "mocli.serve"))]
    assert not shared, shared
    # and the schemes hold no transform: data and predicates over headers only (no numpy, no torch)
    for m in graph:
        if m.startswith("mocli.schemes"):
            src = _modules()[m].read_text()
            assert "import numpy" not in src and "import torch" not in src, m


def test_header_only_commands_never_import_torch():
    """Also verify's early digests: they exist to run while torch is being imported."""
    code = ("import sys; from mocli.cli import main\n"
            "import mocli.inspection, mocli.validate, mocli.checkpoint, mocli.render, mocli.formats.layout\n"
            "import mocli.verify.early\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr


def test_a_command_starts_without_pydantic(tmp_path):
    """The CLI's start-up is part of every header command's second: typer 0.29 coerces each parameter through
    pydantic, whose import alone costs ~0.15-0.3 s on 2 cores (pyproject caps typer below it). A real command
    runs, its arguments parsed and coerced, and pydantic must not have been imported."""
    model = ROOT.parent / "fixtures" / "real" / "llama-ct-fp8"
    code = ("import sys; from mocli.cli import main\n"
            f"try:\n    main(['-q', '--json', 'inspect', {str(model)!r}])\nexcept SystemExit as e:\n    assert not e.code, e\n"
            "assert 'pydantic' not in sys.modules, 'pydantic imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"num_tensors"' in r.stdout


# Where each of a card's code parts must live: the package that builds its table resolves it, so verify
# never loads the converter's or serving's code and planning never loads torch
PART_HOMES = {"planner": "mocli.plan.", "stored": "mocli.module_classes", "kernel": "mocli.serve.",
              "check": "mocli.verify.kinds."}


def _card_faults(c) -> list[str]:
    """What a card lacks or misplaces: an empty scheme or role set, a threshold missing or out of place,
    a code part that does not load or lives outside its package, a transform for no target."""
    import importlib

    from mocli.targets import Target

    faults = [f"{c.kind}: {what}" for what, bad in (
        ("no roles", not c.roles), ("no scheme", not c.schemes), ("no thresholds", c.thresholds is None),
        ("check_torch not a bool", not isinstance(c.check_torch, bool)),
        ("a MoE kind, and only one, has a GEMM2 threshold", c.thresholds is not None and (c.thresholds.gemm2 is None) == c.moe),
        ("its check is not the MoE driver's kind", ("moe" in c.check.module) != c.moe),
        ("a transform for no target", any(t not in set(Target) for t, _ in c.transforms))) if bad]
    for part, ref in c.parts().items():
        if not ref.module.startswith(PART_HOMES[part]):
            faults.append(f"{c.kind}: its {part} {ref.path} is not under {PART_HOMES[part]}")
            continue
        try:
            loaded = ref.load() if part != "check" else importlib.import_module(ref.module).check
        except (ImportError, AttributeError) as e:
            loaded = e
        if not callable(loaded):
            faults.append(f"{c.kind}: its {part} {ref.path} is missing ({loaded})")
    return faults


def test_every_module_kind_is_one_complete_card():
    """A module kind is declared once, as a card (``mocli.kinds.CARDS``): one per kind, each naming every
    part (planner, stored-tensor class, serving kernel, verify check, thresholds), each part found
    where it must live."""
    from mocli.kinds import CARDS

    assert sorted(c.kind for c in CARDS) == sorted(ModuleKind), "one card per module kind, no kind twice"
    assert not [f for c in CARDS for f in _card_faults(c)]


def test_a_card_that_lacks_or_misplaces_a_part_is_caught():
    """The rule above, on planted cards: a kernel that is not there, a check named in serving's package
    (verify would load serving's code), a dense kind with a GEMM2 threshold, a transform for no target."""
    from dataclasses import replace

    from mocli.kinds import KINDS, Part, Thresholds

    card = KINDS[ModuleKind.FP8_LINEAR]
    assert not _card_faults(card)
    for planted, says in ((replace(card, kernel=Part("mocli.serve.dense:NoSuchKernel")), "is missing"),
                          (replace(card, stored=Part("mocli.module_classes:NoSuchClass")), "is missing"),
                          (replace(card, check=Part("mocli.serve.dense:Fp8LinearKernel")), "not under mocli.verify.kinds."),
                          (replace(card, planner=Part("mocli.serve.dense:Fp8LinearKernel")), "not under mocli.plan."),
                          (replace(card, thresholds=Thresholds(0.05, 0.05, gemm2=0.01)), "GEMM2"),
                          (replace(card, roles=frozenset()), "no roles"),
                          (replace(card, transforms=(("flashinfer-cutlas", "x"),)), "no target")):
        faults = _card_faults(planted)
        assert len(faults) == 1 and says in faults[0], faults


def test_every_kind_table_is_derived_from_the_cards():
    """Every per-kind table holds exactly the cards' entries: a table entry no card declares fails here,
    as does a card some table lacks. verify's THRESHOLDS also holds ``mocli quantize``'s outputs."""
    from mocli.kinds import CARDS
    from mocli.module_classes import CLASSES
    from mocli.plan import PLANNERS
    from mocli.serve import KERNELS
    from mocli.targets import REGISTRY
    from mocli.verify.kinds import CHECKS
    from mocli.verify.results import QUANTIZED_THRESHOLDS, THRESHOLDS

    cards = {c.kind: c for c in CARDS}
    assert KINDS == cards
    for name, table, part in (("plan.PLANNERS", PLANNERS, "planner"), ("module_classes.CLASSES", CLASSES, "stored"),
                              ("serve.KERNELS", KERNELS, "kernel")):
        assert set(table) == set(cards), f"{name}: {sorted(set(table) ^ set(cards))} not as the cards say"
        wrong = [k for k, v in table.items() if v is not cards[k].parts()[part].load()]
        assert not wrong, f"{name}: {wrong} differ from their cards"
    assert set(CHECKS) == set(cards)
    assert all(f"mocli.verify.kinds.{c.module}" == cards[k].check.module and c.torch is cards[k].check_torch
               for k, c in CHECKS.items())
    assert THRESHOLDS == {**{k: c.thresholds for k, c in cards.items()}, **QUANTIZED_THRESHOLDS}
    assert not set(QUANTIZED_THRESHOLDS) & set(ModuleKind)
    for target, layout in REGISTRY.items():
        declared = {c.kind: t for c in CARDS for tt, t in c.transforms if tt == target}
        assert layout.weight_transforms == declared and set(declared) <= layout.kinds, target


def test_no_per_kind_table_is_written_by_hand():
    """The packages whose tables the cards give (planners, stored classes, kernels, checks, thresholds)
    key no dict literal by ``ModuleKind``: a kind's part is declared on its card, not beside it. (A check
    module that serves several kinds dispatches among its own cases: that is not a table.)"""
    files = [*ROOT.glob("plan/*.py"), *ROOT.glob("serve/*.py"), ROOT / "module_classes.py",
             ROOT / "verify" / "results.py", ROOT / "verify" / "quantized.py", ROOT / "verify" / "kinds" / "__init__.py"]
    hand = [f"{p.relative_to(ROOT.parent)}:{n.lineno}" for p in files for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Dict) and any(k is not None and ast.unparse(k).startswith("ModuleKind.") for k in n.keys)]
    assert not hand, hand


NVFP4_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch fails from here on
import numpy as np
from mocli.census import build_census
from mocli.checkpoint import open_checkpoint
from mocli.stream import BufferPool, SourceRange, UnitContext, fingerprint
from mocli.formats import layout
from mocli.io.safetensors_file import TensorReader
from mocli.io.shard_writer import group_layouts
from mocli.parallel import Heads, ParallelLayout
from mocli.plan import build_plan
from mocli.scales import read_scales
from mocli.targets import Target
from mocli.validate import validate

ckpt = open_checkpoint(sys.argv[1])
census = build_census(ckpt.tensors)
scales = read_scales(census)
kinds = {}
for target in Target:
    for tp, ep in ((1, 1), (2, 1), (2, 2)):
        par = ParallelLayout(tp, ep)
        assert not validate(ckpt, target, census, scales, parallel=par).findings.errors
        plan = build_plan(census, scales, target, par, Heads.from_config(ckpt.config))
        lays = group_layouts(list(plan.tensors.values()))
        fingerprint("convert", ckpt.files, lays, {"tensors": {f"{g}/{n}": t.to_dict() for (g, n), t in plan.tensors.items()}})
        layout.manifest_body(plan, target, par)
        ctx = UnitContext(TensorReader(), None, BufferPool())
        assert all(u.torch_free for u in plan.units)
        # marlin's repack moves every weight byte (``Unit.compute``); FlashInfer's NVFP4 layouts copy or gather
        assert any(u.compute for u in plan.units) == (target == "marlin"), target
        copied, computed = set(), set()
        for u in plan.units:
            for p in u.run(ctx):
                assert isinstance(p.data, SourceRange | np.ndarray), (u.id, type(p.data))
                assert p.offset + p.nbytes <= plan.tensors[p.key].nbytes, (u.id, p.key)
                (copied if isinstance(p.data, SourceRange) else computed).add(u.id.split(":")[0])
        kinds[f"{target} tp{tp} ep{ep}"] = sorted(copied - computed)
print(kinds)
"""


def test_nvfp4_conversion_plans_and_runs_without_torch():
    """An NVFP4 conversion needs no torch (``Unit.torch_free``, ``mocli.ops.nvfp4``): with torch
    unimportable, convert's planning (validate, plan, shard layout, fingerprint, manifest) and every
    unit of the real NVFP4 MoE export run, both targets, at one rank and under tp/ep, and every piece
    is source bytes or a numpy array that fits its tensor. cutlass copies every expert's weights in
    the kernel (w2 at tp 2 has its columns sliced); trtllm shuffles their rows and marlin repacks them,
    so only tensors passed through are pure copies."""
    real = ROOT.parent / "fixtures" / "real" / "qwen3_moe-nvfp4_kv"
    r = subprocess.run([sys.executable, "-c", NVFP4_WITHOUT_TORCH, str(real)], capture_output=True, text=True,
                       cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr
    kinds = eval(r.stdout)  # noqa: S307 - our own subprocess's repr of a dict of lists
    for tp, ep in ((1, 1), (2, 2)):
        assert kinds[f"flashinfer-cutlass tp{tp} ep{ep}"] == ["copy", "w13", "w2"]
        assert kinds[f"flashinfer-trtllm tp{tp} ep{ep}"] == ["copy"]
    assert kinds["flashinfer-cutlass tp2 ep1"] == ["copy", "w13"]  # w2's columns are sliced per rank
    assert all(kinds[f"marlin tp{tp} ep{ep}"] == ["copy"] for tp, ep in ((1, 1), (2, 1), (2, 2)))  # repacked
