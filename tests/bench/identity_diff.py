"""Byte comparison of two output directories for ``identity.py`` (issue 45: outputs byte-identical to the
previous release's).

A file is ``identical`` (same bytes), ``version-only`` (a JSON file whose only differences are the fields
that record the producer's version, or the size/digest that another file lists for a file that is itself
identical or version-only: ``mocli-layout.json`` lists ``config.json``'s digest, and ``config.json`` carries
the version; or a digest record whose algorithm the producer changed, ``algorithm_swaps``) or ``differs``,
with the JSON paths or tensor names that differ.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mocli.io.digests import ALGORITHMS  # the keys of a digest record

IDENTICAL, VERSION_ONLY, DIFFERS = "identical", "version-only", "differs"
RANK = {IDENTICAL: 0, VERSION_ONLY: 1, DIFFERS: 2}
DIGEST_KEYS = {*ALGORITHMS, "size", "digest", "bytes"}
SWAPPED = "<digest algorithm>"  # the one difference a record whose algorithm changed makes
SHOWN = 6  # differing paths / tensors named per file


@dataclass
class FileDiff:
    path: str
    status: str
    details: list[str] = field(default_factory=list)


def files_of(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def json_paths(a, b, path: tuple = ()) -> list[tuple[tuple, object, object]]:
    """Every leaf path (a tuple of keys and indexes) where two parsed JSON values differ; a missing key
    is a difference, and so is the same keys in another order."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                out.append(((*path, k), a.get(k, "<absent>"), b.get(k, "<absent>")))
            else:
                out += json_paths(a[k], b[k], (*path, k))
        if list(a) != list(b) and not out:
            out.append((path, "<key order>", "<another key order>"))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in json_paths(x, y, (*path, i))]
    return [] if a == b and type(a) is type(b) else [(path, a, b)]


def algorithm_swaps(diffs: list[tuple[tuple, object, object]]) -> list[tuple[tuple, object, object]]:
    """A digest record whose algorithm the producer changed (``{"blake3": x}`` -> ``{"xxh3_128": y}``: one key
    gone, another come, in the same record) as one difference at ``.../<digest algorithm>``, the two
    algorithms its values; a record lost or added whole stays what it is."""
    def ends(side: int) -> dict:
        return {d[0][:-1]: d[0][-1] for d in diffs if d[0] and d[0][-1] in ALGORITHMS and d[side] == "<absent>"}

    gone, came = ends(2), ends(1)
    both = gone.keys() & came.keys()
    kept = [d for d in diffs if not (d[0] and d[0][-1] in ALGORITHMS and d[0][:-1] in both)]
    return kept + [((*p, SWAPPED), gone[p], came[p]) for p in sorted(both, key=str)]


def show(path: tuple) -> str:
    return "/" + "/".join(map(str, path))


def _tolerated(path: tuple, a, b, versions: tuple[str, str], settled: set[str]) -> bool:
    """A producer-version field, a digest record whose algorithm changed (``algorithm_swaps``), or the
    size/digest recorded for a file that differs only so."""
    if path and (path[-1] == "version" and {a, b} == set(versions) or path[-1] == SWAPPED):
        return True
    return bool(path) and path[-1] in DIGEST_KEYS and any(p in settled for p in path[:-1])


def _safetensors(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()[:8]
    n = struct.unpack("<Q", raw)[0]
    with open(path, "rb") as f:
        f.seek(8)
        return json.loads(f.read(n)), 8 + n


def tensor_diff(a: Path, b: Path) -> list[str]:
    """Names of the tensors whose dtype, shape or bytes differ, and header-level differences."""
    try:
        (ha, oa), (hb, ob) = _safetensors(a), _safetensors(b)
    except (OSError, ValueError, struct.error) as e:
        return [f"not comparable as safetensors: {e}"]
    out = [f"metadata{show(p)}: {x!r} -> {y!r}" for p, x, y in json_paths(ha.pop("__metadata__", {}), hb.pop("__metadata__", {}))]
    da, db = a.read_bytes(), b.read_bytes()
    for name in list(ha) + [n for n in hb if n not in ha]:
        x, y = ha.get(name), hb.get(name)
        if x is None or y is None:
            out.append(f"{name}: only in {'head' if x is None else 'base'}")
        elif (x["dtype"], x["shape"]) != (y["dtype"], y["shape"]):
            out.append(f"{name}: {x['dtype']}{x['shape']} -> {y['dtype']}{y['shape']}")
        else:
            sa, ea = x["data_offsets"]
            sb, eb = y["data_offsets"]
            if da[oa + sa:oa + ea] != db[ob + sb:ob + eb]:
                out.append(f"{name}: bytes differ")
    return out or ["same tensors, different placement or header order"]


def compare_dirs(base: Path, head: Path, versions: tuple[str, str]) -> list[FileDiff]:
    """One FileDiff per file of either directory, classified as the module docstring says."""
    fa, fb = files_of(base), files_of(head)
    result = {p: FileDiff(p, DIFFERS, [f"only in {'base' if p in fa else 'head'}"]) for p in fa ^ fb}
    pending: dict[str, list] = {}
    for p in sorted(fa & fb):
        if (base / p).read_bytes() == (head / p).read_bytes():
            result[p] = FileDiff(p, IDENTICAL)
        elif p.endswith(".json"):
            try:
                pending[p] = algorithm_swaps(json_paths(json.loads((base / p).read_text()),
                                                        json.loads((head / p).read_text())))
            except ValueError as e:
                result[p] = FileDiff(p, DIFFERS, [f"not JSON: {e}"])
        elif p.endswith(".safetensors"):
            result[p] = FileDiff(p, DIFFERS, tensor_diff(base / p, head / p))
        else:
            result[p] = FileDiff(p, DIFFERS, ["bytes differ"])
    settled = {p for p, d in result.items() if d.status == IDENTICAL}
    changed = True
    while changed:  # a digest of a version-only file is tolerated once that file is settled
        changed = False
        for p, diffs in list(pending.items()):
            if all(_tolerated(path, a, b, versions, settled | {Path(s).name for s in settled}) for path, a, b in diffs):
                result[p] = FileDiff(p, VERSION_ONLY, [show(path) for path, _, _ in diffs])
                settled.add(p)
                del pending[p]
                changed = True
    for p, diffs in pending.items():
        bad = [d for d in diffs if not _tolerated(*d, versions, settled)]
        result[p] = FileDiff(p, DIFFERS, [f"{show(path)}: {_short(a)} -> {_short(b)}" for path, a, b in bad])
    return [result[p] for p in sorted(result)]


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def worst(diffs: list[FileDiff]) -> str:
    return max((d.status for d in diffs), key=RANK.__getitem__, default=IDENTICAL)
