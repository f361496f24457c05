"""``mocli convert``'s kernel-ready layout: the one place that writes and reads it (LAYOUT.md).

Files: the shards of every output group (the top level, ``rank-R/`` per rank of a --tp/--ep output),
an index per group, and the manifest ``mocli-layout.json`` (modules and tensors per rank, the
files' digests, provenance). ``rank_entries`` is "the tensors of rank R": the loader, verify and
the vLLM plugin all read a rank through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mocli.errors import CorruptFileError, InputError
from mocli.formats import INDEX_NAME, write_index, write_json

MANIFEST_NAME = "mocli-layout.json"
FORMAT = "mocli-layout"
LAYOUT_VERSION = 1  # any change to names, dtypes, shapes or byte order bumps it
READABLE_VERSIONS = frozenset({1})


def rank_dir(parallel, rank: int) -> str:
    """Directory of a rank's files, relative to OUT ("" when there is one rank: the tp = 1 layout)."""
    return "" if parallel.single else f"rank-{rank}"


# --- writing ---------------------------------------------------------------------------------------

def manifest_body(plan, target: str, parallel) -> dict[str, Any]:
    """The manifest without ``files`` and ``provenance``: modules and tensors per rank, shared ones once."""

    def tensors(group: str) -> dict[str, Any]:
        return {t.name: t.to_dict() for t in plan.tensors.values() if t.group == group}

    def modules(group: str) -> list[dict[str, Any]]:
        return [m.to_dict() for m in plan.modules if m.group == group]

    body: dict[str, Any] = {"format": FORMAT, "layout_version": LAYOUT_VERSION, "target": str(target),
                            "parallel": parallel.to_dict(), "modules": modules(""), "tensors": tensors("")}
    if not parallel.single:
        body["ranks"] = [{"rank": r, "tp_rank": parallel.tp_rank(r), "dir": rank_dir(parallel, r),
                          "modules": modules(rank_dir(parallel, r)), "tensors": tensors(rank_dir(parallel, r))}
                         for r in range(parallel.ranks)]
    return body


def write_layout(directory: Path, body: dict[str, Any], layouts: dict, digests: dict[str, str],
                 provenance: dict[str, Any]) -> None:
    """Every group's index and the manifest, with each shard's size and digest (relative path -> digest)."""
    sizes = {}
    for group, lay in layouts.items():
        d = directory / group if group else directory
        write_index(d, lay.weight_map(), sum(t.nbytes for f in lay.files for t in f.tensors),
                    mocli_layout=MANIFEST_NAME)
        sizes |= {(f"{group}/{f.name}" if group else f.name): f.size for f in lay.files}
    files = {name: {"size": sizes[name], "sha256": digests[name]} for name in sorted(digests)}
    write_json(directory / MANIFEST_NAME, {**body, "files": files, "provenance": provenance})


# --- reading ---------------------------------------------------------------------------------------

def is_layout(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).exists()


def read_manifest(path: Path) -> dict[str, Any]:
    from mocli.io.jsonfile import read_json

    mpath = Path(path) / MANIFEST_NAME
    if not mpath.exists():
        raise InputError(f"{path}: no {MANIFEST_NAME}; not a mocli-converted checkpoint",
                         hint="run mocli convert first")
    manifest = read_json(mpath)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptFileError(f"{mpath}: not a mocli layout manifest", hint="the file is damaged; convert again")
    if manifest.get("layout_version") not in READABLE_VERSIONS:
        raise InputError(f"{mpath}: layout_version {manifest.get('layout_version')} is not supported "
                         f"(this mocli reads {', '.join(map(str, sorted(READABLE_VERSIONS)))})",
                         hint="convert again with this mocli version")
    return manifest


def rank_view(manifest: dict[str, Any], rank: int | None) -> tuple[str, list[dict], dict[str, Any]]:
    """(directory, modules, tensors) of one rank; the top level for a one-rank output."""
    ranks = manifest.get("ranks")
    if not ranks:
        if rank not in (None, 0):
            raise InputError(f"rank {rank}: this output has one rank", hint="omit rank / --rank")
        return "", manifest["modules"], manifest["tensors"]
    if rank is None:
        raise InputError(f"this output has {len(ranks)} ranks (tp {manifest['parallel']['tp']}, "
                         f"ep {manifest['parallel']['ep']})", hint="pick one with rank=R (--rank R)")
    if not 0 <= rank < len(ranks):
        raise InputError(f"rank {rank}: this output has ranks 0..{len(ranks) - 1}", hint="pick an existing rank")
    r = ranks[rank]
    return r["dir"], r["modules"], r["tensors"]


def group_entries(directory: Path) -> dict:
    """name -> TensorEntry of one output group, from its index and the headers of the shards it names."""
    from mocli.io.jsonfile import read_json
    from mocli.io.safetensors_file import read_header

    index_path = directory / INDEX_NAME
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptFileError(f"{index_path}: no weight_map", hint="the output is damaged; convert again")
    entries: dict = {}
    for fname in sorted(set(weight_map.values())):
        if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
            raise CorruptFileError(f"{index_path}: bad shard name {fname!r}", hint="the output is damaged; convert again")
        entries |= read_header(directory / fname).tensors
    return entries


def rank_entries(path: Path, manifest: dict[str, Any], rank: int | None) -> dict:
    """The tensors of one rank: the shared top-level ones plus the rank directory's, by name."""
    group, _, _ = rank_view(manifest, rank)
    path = Path(path)
    entries = group_entries(path) if (path / INDEX_NAME).exists() else {}
    if group:
        entries |= group_entries(path / group)
    return entries
