"""The manifest ``mocli-layout.json`` as one typed value: ``Layout`` (LAYOUT.md).

``Layout.parse`` is the only place the manifest's JSON is indexed: every field is checked there, once
(its type, the target, the layout version, each module's kind against ``mocli.kinds``, each tensor's
dtype and shape, the rank entries), and a wrong one is exit 2 naming the field by its JSON path and the
file. ``manifest_json`` is the only place it is written (``formats.layout.manifest_body`` builds a
``Layout`` from the plan), so a field exists here and nowhere else. Everything outside ``mocli.formats``
takes the ``Layout``; none of it receives the manifest's dict.

Module entries keep their roles -> tensor names and their per-kind ``meta`` as mappings (``meta`` is
open by design: each kind's keys; the ones the loader and verify read are type-checked here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mocli.errors import CorruptFileError, InputError
from mocli.formats import INDEX_NAME
from mocli.io.digests import as_record
from mocli.io.paths import entry_path

if TYPE_CHECKING:  # imported where a manifest is parsed: reading its file names needs neither
    from mocli.kinds import ModuleKind
    from mocli.targets import Target

MANIFEST_NAME = "mocli-layout.json"
FORMAT = "mocli-layout"
READABLE_VERSIONS = frozenset({1, 2})


@dataclass(frozen=True)
class Parallelism:
    """``parallel``: the --tp/--ep split the output was written for (``moe``: how experts are split)."""

    tp: int = 1
    ep: int = 1
    ranks: int = 1
    moe: str | None = None

    @property
    def single(self) -> bool:
        return self.ranks == 1

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "ep": self.ep, "ranks": self.ranks, **({} if self.moe is None else {"moe": self.moe})}


@dataclass(frozen=True)
class VllmRules:
    """``serving.vllm``: the vLLM releases and rules the output was written for."""

    releases: tuple[str, ...] = ()
    kv_cache_dtype: str = "auto"
    moe: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"releases": list(self.releases), "kv_cache_dtype": self.kv_cache_dtype, "moe": self.moe}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of ``tensors``: what the shard holds under that name, and where it came from."""

    dtype: str
    shape: tuple[int, ...]
    role: str
    sources: tuple[str, ...] = ()
    transforms: tuple[str, ...] = ()

    @property
    def passthrough(self) -> bool:
        return self.role == "passthrough"

    @classmethod
    def table(cls, data: Any, where: str) -> dict[str, TensorInfo]:
        """A ``tensors`` object: name -> TensorInfo, each entry checked."""
        return _tensors(data, where)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "role": self.role, "sources": list(self.sources),
                "transforms": list(self.transforms)}


@dataclass(frozen=True)
class ModuleEntry:
    """One entry of ``modules``: a converted module, its kind, its tensors by role and its ``meta``."""

    name: str
    kind: ModuleKind  # checked against mocli.kinds
    scheme: str
    tensors: dict[str, str]
    sources: tuple[str, ...]
    meta: dict[str, Any]

    @classmethod
    def from_json(cls, data: Any, where: str) -> ModuleEntry:
        return _module(data, where)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": str(self.kind), "scheme": self.scheme, "tensors": self.tensors,
                "sources": list(self.sources), "meta": self.meta}


@dataclass(frozen=True)
class RankEntry:
    """One entry of ``ranks``: rank R's directory (``rank-R``) and what it holds beside the shared tensors."""

    rank: int
    tp_rank: int
    dir: str
    modules: tuple[ModuleEntry, ...]
    tensors: dict[str, TensorInfo]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "tp_rank": self.tp_rank, "dir": self.dir,
                "modules": [m.to_json() for m in self.modules],
                "tensors": {n: t.to_json() for n, t in self.tensors.items()}}


@dataclass(frozen=True)
class Layout:
    """A converted directory's manifest, every field checked (``parse``), or one being written
    (``formats.layout.manifest_body``: no ``path``, ``files`` or ``provenance`` yet). ``files`` is None
    too in a manifest of an old mocli that recorded none. The shared top-level shards' headers are read
    once for every rank (``entries``)."""

    version: int
    target: Target
    parallel: Parallelism
    serving: VllmRules | None
    modules: tuple[ModuleEntry, ...]
    tensors: dict[str, TensorInfo]
    ranks: tuple[RankEntry, ...] = ()
    files: dict[str, dict[str, Any]] | None = None
    provenance: dict[str, Any] | None = None
    path: Path | None = None
    _shared: dict = field(default_factory=dict, compare=False, repr=False)  # "" -> the top level's entries

    @classmethod
    def parse(cls, data: Any, where: Path | str, path: Path | None = None) -> Layout:
        """The manifest ``data`` (parsed JSON of the file ``where``, in the directory ``path``), every
        field checked: InputError for a target or layout version this mocli does not read,
        CorruptFileError naming the field for the rest (both exit 2)."""
        return _parse(data, str(where), path)

    # --- a rank's view ---------------------------------------------------------------------------

    @property
    def rank_ids(self) -> list[int | None]:
        """The ranks to read: 0..R-1, or [None] for a one-rank output (the top level)."""
        return list(range(len(self.ranks))) if self.ranks else [None]

    def rank_id(self, rank: int) -> int | None:
        """``rank`` as the views take it: None for a one-rank output."""
        return rank if self.ranks else None

    def view(self, rank: int | None) -> tuple[str, tuple[ModuleEntry, ...], dict[str, TensorInfo]]:
        """(directory, modules, tensors) of one rank; the top level for a one-rank output."""
        if not self.ranks:
            if rank not in (None, 0):
                raise InputError(f"rank {rank}: this output has one rank", hint="omit rank / --rank")
            return "", self.modules, self.tensors
        if rank is None:
            raise InputError(f"this output has {len(self.ranks)} ranks (tp {self.parallel.tp}, "
                             f"ep {self.parallel.ep})", hint="pick one with rank=R (--rank R)")
        if not 0 <= rank < len(self.ranks):
            raise InputError(f"rank {rank}: this output has ranks 0..{len(self.ranks) - 1}",
                             hint="pick an existing rank")
        r = self.ranks[rank]
        return r.dir, r.modules, r.tensors

    def described(self, rank: int | None) -> dict[str, TensorInfo]:
        """Every tensor one rank reads: the shared ones and its own."""
        return {**self.tensors, **self.view(rank)[2]}

    def all_modules(self) -> list[ModuleEntry]:
        return list(self.modules) + [m for r in self.ranks for m in r.modules]

    def passthrough(self) -> list[str]:
        """The shared tensors copied from the source as they are."""
        return [n for n, t in self.tensors.items() if t.passthrough]

    def entries(self, rank: int | None) -> dict:
        """The tensors of one rank's shards (``formats.layout.rank_entries``), the shared top-level
        headers read once for every rank."""
        if "" not in self._shared:
            self._shared[""] = shared_entries(self.path)
        return with_own(self.path, dict(self._shared[""]), self.view(rank)[0])


def manifest_json(layout: Layout) -> dict[str, Any]:
    """The manifest's JSON, keys in the order every mocli has written them (``formats.layout`` writes
    it; nothing outside ``mocli.formats`` calls this: tests/test_architecture.py)."""
    body: dict[str, Any] = {"format": FORMAT, "layout_version": layout.version, "target": str(layout.target),
                            "parallel": layout.parallel.to_json()}
    if layout.serving is not None:
        body["serving"] = {"vllm": layout.serving.to_json()}
    body["modules"] = [m.to_json() for m in layout.modules]
    body["tensors"] = {n: t.to_json() for n, t in layout.tensors.items()}
    if layout.ranks:
        body["ranks"] = [r.to_json() for r in layout.ranks]
    if layout.files is not None:
        body["files"] = layout.files
    if layout.provenance is not None:
        body["provenance"] = layout.provenance
    return body


# --- a rank's shards ------------------------------------------------------------------------------

def group_entries(root: Path, group: str) -> dict:
    """name -> TensorEntry of one output group (the top level "" or "rank-R"), exactly as its index says:
    every shard the index names (inside the group's directory, no link), each tensor in the one shard
    the index maps it to, and nothing else in those shards."""
    from mocli.formats.index import read_index

    directory = entry_path(root, group, MANIFEST_NAME) if group else Path(root)
    _, tensors = read_index(directory, follow=False)
    return tensors


def shared_entries(path: Path) -> dict:
    """The top-level shards' tensors (none where there is no top-level index)."""
    path = Path(path)
    return group_entries(path, "") if (path / INDEX_NAME).exists() or (path / INDEX_NAME).is_symlink() else {}


def with_own(path: Path, entries: dict, group: str) -> dict:
    """The shared ``entries`` plus the rank directory ``group``'s own (none for ""); a name in both is
    refused."""
    if group:
        own = group_entries(path, group)
        twice = sorted(set(own) & set(entries))
        if twice:
            raise CorruptFileError(f"{path / group}: tensor '{twice[0]}' is also in the top-level shards",
                                   hint="the output is damaged; convert again")
        entries |= own
    return entries


# --- parsing ---------------------------------------------------------------------------------------

def _bad(where: str, what: str) -> CorruptFileError:
    return CorruptFileError(f"{where}: {what}", hint="the manifest is damaged or hostile; convert again")


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _expect(value: Any, kind: type | tuple, where: str, what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _bad(where, f"{what} must be {getattr(kind, '__name__', kind)}, not {type(value).__name__}")
    return value


def _str_list(value: Any, where: str, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise _bad(where, f"{what} must be a list of strings")
    return tuple(value)


# meta keys the loader and verify read, with their types
_META_INTS = {"experts", "intermediate", "hidden", "n", "k", "padded_n", "padded_k", "expert_offset", "tp_rank",
              "experts_total", "intermediate_total", "padded_intermediate", "padded_hidden"}
_META_POWERS_OF_TWO = {"scale_factor", "scale_factor_w13", "scale_factor_w2"}  # the marlin target's
_META_INT_LISTS = {"shard_rows", "intermediate_slice", "block"}


def _meta_problem(key: str, v: Any) -> str | None:
    if key in _META_INTS and not _is_int(v):
        return f"meta.{key} must be a non-negative integer"
    if key in _META_INT_LISTS and not (isinstance(v, list) and all(_is_int(x) for x in v)):
        return f"meta.{key} must be a list of non-negative integers"
    if key == "slices" and not (isinstance(v, list) and all(
            isinstance(x, list) and len(x) == 4 and all(_is_int(y) for y in x) for x in v)):
        return "meta.slices must be [row0, row1, col0, col1] per shard"
    if key == "full" and not (isinstance(v, dict) and all(_is_int(v.get(d)) for d in ("n", "k"))):
        return "meta.full must be {n, k}"
    if key in _META_POWERS_OF_TWO and not (isinstance(v, float) and 1 <= v <= 2.0**127 and math.frexp(v)[0] == 0.5):
        return f"meta.{key} must be a power of two >= 1"
    if key == "act_dtype" and v not in ("bfloat16", "float16"):
        return "meta.act_dtype must be bfloat16 or float16"
    if key in ("naming", "split") and not isinstance(v, str):
        return f"meta.{key} must be a string"
    return None


def _module(m: Any, where: str) -> ModuleEntry:
    from mocli.kinds import ModuleKind

    _expect(m, dict, where, "a module")
    name = _expect(m.get("name"), str, where, "name")
    at = f"{where} ({name})"
    if m.get("kind") not in {k.value for k in ModuleKind}:
        raise _bad(at, f"kind {m.get('kind')!r} is not one this mocli knows")
    scheme = _expect(m.get("scheme"), str, at, "scheme")
    tensors = _expect(m.get("tensors"), dict, at, "tensors")
    if not all(isinstance(v, str) for v in tensors.values()):
        raise _bad(at, "tensors must map roles to tensor names")
    sources = _str_list(m.get("sources"), at, "sources")
    meta = _expect(m.get("meta"), dict, at, "meta")
    for key, v in meta.items():
        problem = _meta_problem(key, v)
        if problem:
            raise _bad(at, problem)
    return ModuleEntry(name, ModuleKind(m["kind"]), scheme, tensors, sources, meta)


def _tensors(tensors: Any, where: str) -> dict[str, TensorInfo]:
    from mocli.io.safetensors_file import DTYPE_SIZES

    _expect(tensors, dict, where, "tensors")
    out = {}
    for name, t in tensors.items():
        at = f"{where}.{name}"
        _expect(t, dict, at, "a tensor entry")
        if t.get("dtype") not in DTYPE_SIZES:
            raise _bad(at, f"dtype {t.get('dtype')!r} is not a safetensors dtype")
        if not isinstance(t.get("shape"), list) or not all(_is_int(d) for d in t["shape"]):
            raise _bad(at, "shape must be a list of non-negative integers")
        out[name] = TensorInfo(t["dtype"], tuple(t["shape"]), _expect(t.get("role"), str, at, "role"),
                               _str_list(t.get("sources"), at, "sources"),
                               _str_list(t.get("transforms"), at, "transforms"))
    return out


def _section(section: dict, prefix: str) -> tuple[tuple[ModuleEntry, ...], dict[str, TensorInfo]]:
    modules = section.get("modules", [])
    _expect(modules, list, prefix + "modules", "modules")
    return (tuple(_module(mod, f"{prefix}modules[{i}]") for i, mod in enumerate(modules)),
            _tensors(section.get("tensors", {}), prefix + "tensors"))


def _parallel(par: Any, at: str) -> Parallelism:
    _expect(par, dict, at, "parallel")
    for key in ("tp", "ep", "ranks"):
        if not _is_int(par.get(key), 1):
            raise _bad(at, f"parallel.{key} must be a positive integer")
    moe = par.get("moe")
    if moe is not None and not isinstance(moe, str):
        raise _bad(at, "parallel.moe must be a string")
    return Parallelism(par["tp"], par["ep"], par["ranks"], moe)


def _ranks(m: dict, par: Parallelism, at: str) -> tuple[RankEntry, ...]:
    ranks = m.get("ranks")
    if par.ranks == 1:
        if ranks is not None:
            raise _bad(at, "ranks[] is only written when parallel.ranks > 1")
        return ()
    if not isinstance(ranks, list) or len(ranks) != par.ranks:
        raise _bad(at, f"parallel.ranks is {par.ranks} but ranks[] lists "
                       f"{len(ranks) if isinstance(ranks, list) else 'none'}")
    out = []
    for r, entry in enumerate(ranks):
        _expect(entry, dict, f"{at}: ranks[{r}]", "a rank entry")
        if entry.get("rank") != r or not _is_int(entry.get("tp_rank")) or entry.get("dir") != f"rank-{r}":
            raise _bad(f"{at}: ranks[{r}]", f"must be rank {r} in directory rank-{r} "
                                            f"(found rank {entry.get('rank')!r}, dir {entry.get('dir')!r})")
        modules, tensors = _section(entry, f"{at}: ranks[{r}].")
        out.append(RankEntry(r, entry["tp_rank"], entry["dir"], modules, tensors))
    return tuple(out)


def _serving(block: Any, at: str) -> VllmRules | None:
    if block is None:
        return None
    if not isinstance(block, dict):
        raise _bad(at, "serving must be an object")
    v = block.get("vllm")
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("kv_cache_dtype", ""), str) \
            or not isinstance(v.get("moe", ""), str):
        raise _bad(at, "serving.vllm must be {releases, kv_cache_dtype, moe}")
    return VllmRules(_str_list(v.get("releases", []), at, "serving.vllm.releases"), v.get("kv_cache_dtype", "auto"),
                     v.get("moe", ""))


def _files(files: Any, at: str) -> dict[str, dict[str, Any]] | None:
    if files is None:
        return None
    _expect(files, dict, at, "files")
    for name, info in files.items():
        if not (isinstance(info, dict) and _is_int(info.get("size")) and as_record(info) is not None):
            raise _bad(f"{at}: files[{name!r}]", "must be {size, xxh3_128} (or {size, blake3}, {size, sha256})")
    return files


def _parse(m: Any, at: str, path: Path | None) -> Layout:
    from mocli.targets import Target

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptFileError(f"{at}: not a mocli layout manifest", hint="the file is damaged; convert again")
    if m.get("layout_version") not in READABLE_VERSIONS:
        raise InputError(f"{at}: layout_version {m.get('layout_version')!r} is not supported "
                         f"(this mocli reads {', '.join(map(str, sorted(READABLE_VERSIONS)))})",
                         hint="convert again with this mocli version")
    _expect(m.get("target"), str, at, "target")
    if m["target"] not in {t.value for t in Target}:
        raise InputError(f"{at}: target {m['target']!r} is not one this mocli knows "
                         f"({', '.join(t.value for t in Target)})", hint="convert again with this mocli")
    par = _parallel(m.get("parallel"), at)
    modules, tensors = _section(m, f"{at}: ")
    ranks = _ranks(m, par, at)
    provenance = m.get("provenance", {})
    if not isinstance(provenance, dict):
        raise _bad(at, "provenance must be an object")
    return Layout(m["layout_version"], Target(m["target"]), par, _serving(m.get("serving"), at), modules, tensors,
                  ranks, _files(m.get("files"), at), provenance, path)
