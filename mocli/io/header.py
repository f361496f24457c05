"""Safetensors headers, parsed and checked without loading the file.

We parse the header ourselves instead of ``safetensors.safe_open``: safe_open reports a corrupt file
as one opaque error, and we need to name the tensor and the fault (overlap, truncation, shape/size
mismatch) in a one-line message. It is also faster for 90k-tensor checkpoints: the headers the safetensors
library writes are read in C where that is built (csrc/safetensors_header.c), any other in one JSON parse per
shard with its entries checked column by column, and ``read_headers`` parses half of a sharded checkpoint's
headers on a second core (``mocli.io.aside``).
"""

from __future__ import annotations

import hashlib
import marshal
import math
import os
import struct
from dataclasses import dataclass
from itertools import chain, repeat
from pathlib import Path
from typing import NamedTuple

from mocli.errors import CorruptFileError, MocliError, read_error
from mocli.io.aside import aside
from mocli.io.jsonfile import parse_json_bytes, two_level_keys
from mocli.io.paths import open_regular
from mocli.procenv import native

# The headers the safetensors library writes, read in C (csrc/safetensors_header.c: read_header of a 1,555-tensor
# header 1.3 ms against ~5.5 by orjson and the column checks, 2-core build VM); None where it was not built (or
# MOCLI_NATIVE=0): the same columns from those
_NATIVE = native("mocli.io._safetensors_header")

# Bytes per element for every safetensors dtype string (safetensors `Dtype`).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


# A header larger than this is not a real checkpoint (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file: where its bytes are, not the bytes.

    A NamedTuple rather than a frozen dataclass: a 95,000-tensor checkpoint builds one per tensor
    at every start, and tuple construction is several times cheaper."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    path: Path
    size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    header_sha256: str  # of the raw JSON header: identifies layout and offsets without rereading


def read_header(path: Path, follow: bool = True) -> SafetensorsHeader:
    """Parse and check one safetensors header; raise CorruptFileError naming the fault. ``follow``:
    whether ``path`` may be a symbolic link (a source in the Hugging Face cache), see io.paths."""
    size, raw = _raw_header(path, follow)
    data_start = 8 + len(raw)
    fast = _NATIVE.parse(raw, data_start, size - data_start) if _NATIVE is not None else None
    if fast is not None:
        names, *columns, metadata = fast
        return SafetensorsHeader(path, size, data_start, _entries(path, names, *columns), metadata,
                                 hashlib.sha256(raw).hexdigest())
    header, metadata = _parsed(path, raw)
    columns = _columns(header, data_start, size - data_start)
    tensors = _checked_entries(path, header, data_start, size - data_start) if columns is None else \
        _entries(path, list(header), *columns)
    return SafetensorsHeader(path, size, data_start, tensors, metadata, hashlib.sha256(raw).hexdigest())


# A checkpoint with fewer shards than this reads its headers in this process: a fork costs more than
# half of a few headers.
ASIDE_SHARDS = 8


def read_headers(paths: list[Path], follow: bool = True) -> list[SafetensorsHeader]:
    """``read_header`` of each path, every other one parsed in a forked child where one may be
    (``mocli.io.aside``; 0.45 -> 0.3 s for a 94,858-tensor checkpoint's 62 headers on the 2-core build VM).
    Any shard the child could not read cleanly, and all of them after an error here, are read again in
    this process, in order: a faulty checkpoint raises the error a serial read raises."""
    if len(paths) < ASIDE_SHARDS:
        return [read_header(p, follow) for p in paths]
    theirs = paths[1::2]
    with aside(lambda: marshal.dumps([_columns_or_none(p, follow) for p in theirs])) as job:
        try:
            mine = [read_header(p, follow) for p in paths[::2]]
        except MocliError:
            mine = None
        sent = job.result() if job is not None and mine is not None else None
    if mine is None:
        return [read_header(p, follow) for p in paths]
    got = marshal.loads(sent) if sent is not None else [None] * len(theirs)
    out = []
    for i, p in enumerate(paths):
        if i % 2 == 0:
            out.append(mine[i // 2])
        else:
            cols = got[i // 2]
            out.append(read_header(p, follow) if cols is None else _from_columns(p, cols))
    return out


def _columns_or_none(path: Path, follow: bool) -> tuple | None:
    """A child's reading of one header: what ``_from_columns`` needs (marshal's types only), or None
    where anything is off (the parent reads the file itself and names the fault)."""
    try:
        size, raw = _raw_header(path, follow)
        data_start = 8 + len(raw)
        fast = _NATIVE.parse(raw, data_start, size - data_start) if _NATIVE is not None else None
        if fast is None:
            header, metadata = _parsed(path, raw)
            columns = _columns(header, data_start, size - data_start)
            if columns is None:
                return None
            fast = (list(header), *columns, metadata)
    except MocliError:
        return None
    names, *columns, metadata = fast
    return size, data_start, names, *columns, metadata, hashlib.sha256(raw).hexdigest()


def _from_columns(path: Path, cols: tuple) -> SafetensorsHeader:
    size, data_start, names, dtypes, shapes, starts, nbytes, metadata, sha = cols
    return SafetensorsHeader(path, size, data_start, _entries(path, names, dtypes, shapes, starts, nbytes),
                             metadata, sha)


def _parsed(path: Path, raw: bytes) -> tuple[dict, dict]:
    """(the tensors' entries as parsed, ``__metadata__``) of ``path``'s raw JSON header."""
    header = parse_json_bytes(raw, path, "header", walk=False, keys=two_level_keys)  # a tensor named twice: refused
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header is not a JSON object", hint="the file is not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CorruptFileError(f"{path}: __metadata__ is not an object", hint="the header is corrupt")
    return header, dict(metadata)


def _raw_header(path: Path, follow: bool) -> tuple[int, bytes]:
    """The file's size and its header's JSON bytes."""
    fd = open_regular(path, follow)
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "rb", closefd=False) as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError(f"{path}: file is {size} bytes, too short for a safetensors header",
                                       hint="the file is truncated; download it again")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CorruptFileError(
                    f"{path}: header length {n} is larger than the file ({size} bytes)",
                    hint="the file is truncated or not a safetensors file")
            raw = f.read(n)
    except OSError as e:
        raise read_error(path, e) from None
    finally:
        os.close(fd)
    return size, raw


def _entries(path: Path, names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], starts: list[int],
             nbytes: list[int]) -> dict[str, TensorEntry]:
    """Entries from checked columns, built in C (``tuple.__new__`` of the NamedTuple: no Python ``__new__``)."""
    entries = map(tuple.__new__, repeat(TensorEntry), zip(names, repeat(path), dtypes, shapes, starts, nbytes, strict=False))
    return dict(zip(names, entries, strict=True))


def _columns(header: dict, data_start: int, data_size: int) -> tuple | None:
    """``_clean_columns``, None for any header it does not take."""
    try:
        return _clean_columns(header, data_start, data_size)
    except (TypeError, KeyError, ValueError):
        return None


def _clean_columns(header: dict, data_start: int, data_size: int) -> tuple | None:
    """(dtypes, shapes, absolute starts, byte sizes) of a header with nothing wrong, checked column by
    column in C builtins; None (or TypeError, KeyError, ValueError) where anything is off, and
    ``_checked_entries`` names the fault. Stricter than it, never looser: what this accepts, it accepts
    with the same entries."""
    infos = list(header.values())
    if set(map(type, infos)) - {dict}:
        return None
    dtypes = [i["dtype"] for i in infos]
    dims = [i["shape"] for i in infos]
    offsets = [i["data_offsets"] for i in infos]
    widths = list(map(DTYPE_SIZES.get, dtypes))  # an unhashable dtype raises TypeError
    flat = list(chain.from_iterable(dims))
    if (None in widths or set(map(type, dtypes)) - {str} or set(map(type, dims)) - {list}
            or set(map(type, flat)) - {int} or (flat and min(flat) < 0)
            or set(map(type, offsets)) - {list} or set(map(len, offsets)) - {2}):
        return None
    begins, ends = [o[0] for o in offsets], [o[1] for o in offsets]
    if set(map(type, begins)) - {int} or set(map(type, ends)) - {int}:
        return None
    if infos and (min(begins) < 0 or max(ends) > data_size):
        return None
    nbytes = list(map(int.__sub__, ends, begins))
    if nbytes != list(map(int.__mul__, map(math.prod, dims), widths)):  # sizes are >= 0: no end before its begin
        return None
    spans = sorted(zip(begins, ends, strict=True))
    if not all(map(int.__le__, [e for _, e in spans[:-1]], [b for b, _ in spans[1:]])):  # no overlap
        return None
    return dtypes, list(map(tuple, dims)), list(map(data_start.__add__, begins)), nbytes


def _checked_entries(path: Path, header: dict, data_start: int, data_size: int) -> dict[str, TensorEntry]:
    """Each tensor's entry, checked one at a time (dtype, shape, offsets inside the data, no two
    overlapping), naming the first fault."""
    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    sizes = DTYPE_SIZES
    prod = math.prod
    for name, info in header.items():
        # Runs once per tensor of every shard at every start: checks done by C builtins where possible.
        try:
            dtype, dims, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = prod(dims) if type(dims) is list else None
            ok = (type(count) is int and type(begin) is int and type(end) is int and begin >= 0
                  and (not dims or min(dims) >= 0))
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CorruptFileError(f"{path}: tensor '{name}' has a malformed header entry (needs dtype, "
                                   "shape and data_offsets [begin, end])", hint="the header is corrupt; "
                                   "re-export or download the file again")
        width = sizes.get(dtype) if type(dtype) is str else None
        if width is None:
            raise CorruptFileError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}",
                                   hint="safetensors dtypes are " + ", ".join(DTYPE_SIZES) +
                                   "; the file is corrupt or from a newer format")
        if end < begin:
            raise CorruptFileError(f"{path}: tensor '{name}' has reversed offsets [{begin}, {end}]",
                                   hint="the header is corrupt; re-export or download the file again")
        expected = count * width
        if end - begin != expected:
            raise CorruptFileError(
                f"{path}: tensor '{name}' {dtype}{dims} needs {expected} bytes but its offsets "
                f"span {end - begin}", hint="the header is corrupt")
        if end > data_size:
            raise CorruptFileError(
                f"{path}: tensor '{name}' ends at byte {end} of the data but the file holds {data_size}",
                hint="the file is truncated; download it again")
        shape = tuple(dims)
        spans.append((begin, end, name))
        tensors[name] = TensorEntry(name, path, dtype, shape, data_start + begin, end - begin)
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise CorruptFileError(f"{path}: tensors '{n0}' and '{n1}' overlap (bytes {b1}..{e0})",
                                   hint="the header is corrupt")
    return tensors
