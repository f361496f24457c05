"""Static compatibility of mocli's vLLM plugin with a vLLM release, read from the release's source.

``source_tree(version)`` downloads the release's wheel once (``pip download``, no dependencies; the
cache is ``$MOCLI_VLLM_WHEELS`` or ``<repo>/.whl/``) and extracts only ``vllm/**/*.py`` into
``CACHE/vllm-VERSION/``, after which the wheel may be deleted. ``check_source(root, requirements)``
resolves each entry of ``mocli.vllm_plugin.requirements`` in that tree with ``ast``, importing nothing:
the module file, the name (following ``from x import y`` and ``import *`` re-exports, relative ones included), class members
(through the base classes that vLLM defines), signatures and abstract methods, with the messages
``probe`` gives at run time. A patched function must also be imported by name nowhere in vLLM at module
level: such a caller would keep the original.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from mocli.vllm_plugin.requirements import (
    ATTRIBUTE,
    CLASS,
    DICT,
    FUNCTION,
    METHOD,
    MODULE,
    Requirement,
    abstract_problems,
    param_problems,
)

ROOT = Path(__file__).resolve().parents[1]
MAX_HOPS = 12  # re-exports followed for one name
WHEEL_PLATFORM = "manylinux_2_28_x86_64"  # the same .py files whatever machine runs the check


class WheelUnavailable(RuntimeError):
    """The wheel could not be downloaded (no network, no such release)."""


def wheel_cache() -> Path:
    return Path(os.environ.get("MOCLI_VLLM_WHEELS") or ROOT / ".whl")


def download_wheel(version: str, cache_dir: Path | None = None) -> Path:
    """The release's wheel in the cache, downloaded when it is not there yet."""
    cache_dir = cache_dir or wheel_cache()
    found = sorted(cache_dir.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "--platform", WHEEL_PLATFORM, "--retries", "1", "--timeout", "30", "-d", str(cache_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache_dir.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WheelUnavailable(f"pip download vllm=={version} failed: {tail[0]}")
    return found[0]


def extract_sources(wheel: Path, dest: Path) -> Path:
    """``vllm/**/*.py`` of the wheel under ``dest`` (complete or absent: extracted beside, then renamed)."""
    if dest.is_dir():
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(partial, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    partial.rename(dest)
    return dest


def source_tree(version: str, cache_dir: Path | None = None) -> Path:
    """The directory holding the release's ``vllm/`` package sources (raises WheelUnavailable)."""
    cache_dir = cache_dir or wheel_cache()
    dest = cache_dir / f"vllm-{version}"
    return dest if dest.is_dir() else extract_sources(download_wheel(version, cache_dir), dest)


# --- resolving names in a source tree --------------------------------------------------------------------


class _From(NamedTuple):  # from MODULE import NAME
    module: str
    name: str


class _Module(NamedTuple):  # import MODULE (as x)
    module: str


class _Class(NamedTuple):
    module: str
    node: ast.ClassDef


def _is_type_checking(test: ast.expr) -> bool:
    return (test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)) == "TYPE_CHECKING"


def _assigned_names(targets: list[ast.expr]) -> list[str]:
    """Names bound by assignment targets (``a = ``, ``a, b = ``), not attributes or items set."""
    out = []
    for t in targets:
        if isinstance(t, ast.Starred):
            t = t.value
        if isinstance(t, ast.Name):
            out.append(t.id)
        elif isinstance(t, ast.Tuple | ast.List):
            out += _assigned_names(t.elts)
    return out


def _decorators(fn: ast.AST) -> set[str]:
    names = set()
    for d in getattr(fn, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[tuple[str, str, bool]]:
    """(name, inspect.Parameter kind name, required) per parameter, self/cls left out of a method's."""
    a = fn.args
    positional = [(x.arg, "POSITIONAL_ONLY") for x in a.posonlyargs] + [(x.arg, "POSITIONAL_OR_KEYWORD") for x in a.args]
    first_default = len(positional) - len(a.defaults)
    sig = [(name, kind, i < first_default) for i, (name, kind) in enumerate(positional)]
    if method and "staticmethod" not in _decorators(fn):
        sig = sig[1:]
    if a.vararg:
        sig.append((a.vararg.arg, "VAR_POSITIONAL", False))
    sig += [(x.arg, "KEYWORD_ONLY", d is None) for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        sig.append((a.kwarg.arg, "VAR_KEYWORD", False))
    return sig


class SourceTree:
    """Module-level bindings of a source tree's modules, parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._bindings: dict[str, tuple[dict[str, object], list[str]] | None] = {}

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for f in (base / "__init__.py", base.with_suffix(".py")):
            if f.is_file():
                return f
        return None

    def bindings(self, module: str) -> tuple[dict[str, object], list[str]] | None:
        """(name -> class/def/assignment node, _From or _Module; modules star-imported), None: no module."""
        if module not in self._bindings:
            f = self.file(module)
            if f is None:
                self._bindings[module] = None
            else:
                names: dict[str, object] = {}
                stars: list[str] = []
                package = module if f.name == "__init__.py" else module.rpartition(".")[0]
                self._collect(ast.parse(f.read_bytes(), str(f)).body, package, names, stars)
                self._bindings[module] = names, stars
        return self._bindings[module]

    def _collect(self, body: list[ast.stmt], package: str, names: dict[str, object], stars: list[str]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign):
                for name in _assigned_names(node.targets):
                    names[name] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                names[node.target.id] = node
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(package, node.level, node.module)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    else:
                        names[alias.asname or alias.name] = _From(source, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name if alias.asname else alias.name.partition(".")[0]
                    names[alias.asname or top] = _Module(top)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    self._collect(node.body, package, names, stars)
                self._collect(node.orelse, package, names, stars)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    self._collect(block, package, names, stars)
            elif isinstance(node, ast.With):
                self._collect(node.body, package, names, stars)

    def resolve(self, module: str, name: str, hops: int = 0) -> tuple[str, object] | None:
        """(defining module, node) of ``module.name``: a node, or _Module for a module; None: not there."""
        found = self.bindings(module)
        if found is None or hops > MAX_HOPS:
            return None
        names, stars = found
        node = names.get(name)
        if node is None:
            for star in stars:
                exported = self._all(star)
                if (name in exported) if exported is not None else not name.startswith("_"):
                    hit = self.resolve(star, name, hops + 1)
                    if hit is not None:
                        return hit
            return None
        if isinstance(node, _From):
            hit = self.resolve(node.module, node.name, hops + 1)
            if hit is None and self.file(f"{node.module}.{node.name}"):  # from package import submodule
                return f"{node.module}.{node.name}", _Module(f"{node.module}.{node.name}")
            return hit
        if isinstance(node, _Module):
            return (node.module, node) if self.file(node.module) else None
        return module, node

    def _all(self, module: str) -> set[str] | None:
        found = self.bindings(module)
        node = found[0].get("__all__") if found else None
        if isinstance(node, ast.Assign | ast.AnnAssign):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return None
        return None

    def class_of(self, module: str, expr: ast.expr) -> _Class | None:
        """The vLLM class a base-class expression names; None for one defined elsewhere (torch, abc)."""
        if isinstance(expr, ast.Subscript):  # Generic[T], Base[T]
            expr = expr.value
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        hit = self.resolve(module, expr.id)
        for part in parts:
            if hit is None or not isinstance(hit[1], _Module):
                return None
            sub = f"{hit[1].module}.{part}"
            hit = self.resolve(hit[1].module, part) or ((sub, _Module(sub)) if self.file(sub) else None)
        return _Class(hit[0], hit[1]) if hit is not None and isinstance(hit[1], ast.ClassDef) else None

    def mro(self, cls: _Class) -> list[_Class]:
        """C3 linearization over the bases vLLM defines (the others have nothing the plugin requires)."""
        bases = [b for b in (self.class_of(cls.module, e) for e in cls.node.bases) if b is not None]
        seqs = [self.mro(b) for b in bases] + [bases]
        out = [cls]
        while any(seqs):
            seqs = [s for s in seqs if s]
            head = next((s[0] for s in seqs if not any(s[0] in t[1:] for t in seqs)), seqs[0][0])
            out.append(head)
            seqs = [s[1:] if s[0] == head else s for s in seqs]
        return out

    def member(self, cls: _Class, name: str, on_self: bool) -> ast.AST | None:
        """The first definition of ``name`` along the MRO: def, class-level assignment or annotation, and
        with ``on_self`` an assignment to ``self.name`` in a method."""
        for klass in self.mro(cls):
            for node in klass.node.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                    return node
                if isinstance(node, ast.Assign | ast.AnnAssign) and name in _assigned_names(
                        node.targets if isinstance(node, ast.Assign) else [node.target]):
                    return node
        if on_self:
            for klass in self.mro(cls):
                for node in ast.walk(klass.node):
                    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and any(
                            isinstance(t, ast.Attribute) and t.attr == name and getattr(t.value, "id", "") == "self"
                            for t in targets):
                        return node
        return None

    def abstract_methods(self, cls: _Class) -> set[str]:
        decided: dict[str, bool] = {}
        for klass in self.mro(cls):
            for node in klass.node.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    decided.setdefault(node.name, "abstractmethod" in _decorators(node))
                elif isinstance(node, ast.Assign):
                    for target in _assigned_names(node.targets):
                        decided.setdefault(target, False)
        return {name for name, abstract in decided.items() if abstract}

    def importers(self, module: str, name: str) -> list[str]:
        """Modules that bind ``name`` from ``module`` at module level (``from module import name``)."""
        out = []
        for f in sorted(self.root.rglob("*.py")):
            if name.encode() not in f.read_bytes():
                continue
            importer = ".".join(f.relative_to(self.root).with_suffix("").parts).removesuffix(".__init__")
            found = self.bindings(importer)
            if importer != module and found and _From(module, name) in found[0].values():
                out.append(importer)
        return out


def _absolute(package: str, level: int, module: str | None) -> str:
    if level:
        package = ".".join(package.split(".")[:len(package.split(".")) - level + 1])
    return ".".join(filter(None, [package if level else "", module or ""]))


def check_source(root: Path, requirements: Iterable[Requirement]) -> list[str]:
    """Every problem of ``requirements`` in the vLLM source under ``root`` (the directory holding
    ``vllm/``), as ``probe`` words them; [] when all resolve."""
    tree = SourceTree(root)
    return [problem for req in requirements for problem in _check(tree, req)]


def _check(tree: SourceTree, req: Requirement) -> list[str]:
    if tree.file(req.module) is None:
        return [f"{req.module}: cannot import (no such module)"]
    if not req.name:
        return [] if req.kind == MODULE else [f"{req.path}: not a {req.kind}"]
    head, _, member = req.name.partition(".")
    hit = tree.resolve(req.module, head)
    if hit is None:
        return [f"{req.module}: no attribute {head}"]
    module, node = hit
    if member:
        if not isinstance(node, ast.ClassDef):
            return [f"{req.module}.{head}: not a class, has no attribute {member}"]
        owner = _Class(module, node)
        node = tree.member(owner, member, on_self=req.kind == ATTRIBUTE)
        if node is None:
            return [f"{req.module}.{head}: no attribute {member}"]
    out = _kind_problems(req, node)
    if out:
        return out
    if req.implements:
        out += abstract_problems(req, tree.abstract_methods(_Class(module, node)))
    if req.params is not None:
        out += param_problems(req, _signature(node, method=req.kind == METHOD))
    if req.patched and req.kind == FUNCTION:
        out += [f"{req.path}: imported by name in {m}, which the patch does not reach"
                for m in tree.importers(module, head)]
    return out


def _kind_problems(req: Requirement, node: object) -> list[str]:
    is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ok = {
        CLASS: isinstance(node, ast.ClassDef),
        FUNCTION: is_def,
        METHOD: is_def,
        DICT: isinstance(getattr(node, "value", None), ast.Dict | ast.DictComp)
        or (isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation).startswith("dict")),
    }.get(req.kind, True)
    return [] if ok else [f"{req.path}: not a {req.kind}"]
