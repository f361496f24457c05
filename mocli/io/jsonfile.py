"""JSON from files we do not control: parse errors, nesting and invalid text become one-line errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from itertools import compress, repeat
from pathlib import Path
from typing import Any

import orjson

from mocli.errors import CorruptFileError

# No checkpoint file nests anywhere near this deep; deeper input is hostile or broken, and would
# otherwise surface later as a RecursionError in whatever walks it.
MAX_DEPTH = 64
_NOT_READ = object()
# A lone UTF-16 surrogate can only enter through a \uD800-\uDFFF escape (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_bytes(raw: bytes, path: Path, what: str = "file", walk: bool = True,
                     keys: Callable[[Any], int] | None = None) -> Any:
    """json.loads with the failures of hostile input turned into CorruptFileError naming ``path``.

    ``walk=False`` (safetensors headers, whose fixed structure the caller checks entry by entry)
    skips the depth walk; strings are still checked whenever the text holds a surrogate escape.

    A key that appears twice in one object is refused: ``json`` keeps the last silently, other
    readers the first or neither (a MIXED_PRECISION layer named twice would take the later scheme).
    Cheap check first: every key is followed by exactly one colon, so when the raw text holds no
    more colons than the parsed objects hold keys, no key was dropped; only otherwise (a duplicate,
    or colons inside strings) is the text parsed again with a hook that names the key. ``keys``
    counts the parsed keys without the walk (a caller that knows its structure); it may count
    fewer, never more, than there are."""
    try:
        data = orjson.loads(raw)  # 1.5-2x json's speed (a large checkpoint's headers and index: ~0.1 s of 2 cores)
    except orjson.JSONDecodeError:  # what orjson refuses (NaN, a lone surrogate, 1e400, deep nesting, another
        data = _NOT_READ              # encoding, or plain bad JSON), json's own reading decides and explains
    try:
        if data is _NOT_READ:
            data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: {what} is not valid JSON ({e})",
                               hint="the file is corrupt or truncated; re-export or download it again") from None
    except RecursionError:
        raise CorruptFileError(f"{path}: {what} nests JSON too deeply to read",
                               hint="the file is corrupt or hostile; re-export or download it again") from None
    suspicious = b"\\u" in raw and bool(_SURROGATE_ESCAPE.search(raw))  # plain search first: escapes are rare
    if walk or suspicious:
        counted = _check_tree(data, path, what, check_text=suspicious)
    else:
        counted = _count_keys(data, keys)
    if raw.count(b":") > counted:
        _refuse_duplicate_keys(raw, path, what)
    return data


def two_level_keys(data: dict) -> int:
    """The keys of an object and of its object values, at C speed: all of them in a safetensors header
    (names, each entry's fields, ``__metadata__``'s) or an index (``weight_map``'s names); deeper
    objects go uncounted, which only costs the slow check."""
    values = data.values()
    return len(data) + sum(map(len, compress(values, map(isinstance, values, repeat(dict)))))


def _count_keys(data: Any, keys: Callable[[Any], int] | None) -> int:
    if keys is not None:
        try:
            return keys(data)
        except (TypeError, AttributeError):
            pass  # not the structure the caller expected: count it the slow way
    n, stack = 0, [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            n += len(node)
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
    return n


def _refuse_duplicate_keys(raw: bytes, path: Path, what: str) -> None:
    def hook(pairs: list) -> dict:
        d = dict(pairs)
        if len(d) < len(pairs):
            seen: set = set()
            for k, _ in pairs:
                if k in seen:
                    where = "" if what == "file" else f" of its {what}"
                    raise CorruptFileError(
                        f"{path}: the key {k!r} appears twice in one object{where}",
                        hint="JSON readers disagree on which one counts (Python's keeps the last); "
                             "remove the one that is wrong")
                seen.add(k)
        return d

    json.loads(raw, object_pairs_hook=hook)


def _check_tree(data: Any, path: Path, what: str, check_text: bool) -> int:
    """Depth limit always; strings only when the raw text had a surrogate escape (fast path).
    Returns the number of keys of all objects."""
    stack, n = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptFileError(f"{path}: {what} nests JSON deeper than {MAX_DEPTH} levels",
                                   hint="the file is corrupt or hostile; re-export or download it again")
        if isinstance(node, dict):
            n += len(node)
            for k, v in node.items():
                if check_text:
                    _check_text(k, path, what)
                if isinstance(v, dict | list):
                    stack.append((v, depth + 1))
                elif check_text and isinstance(v, str):
                    _check_text(v, path, what)
        elif isinstance(node, list):
            for v in node:
                if isinstance(v, dict | list):
                    stack.append((v, depth + 1))
                elif check_text and isinstance(v, str):
                    _check_text(v, path, what)
    return n


def _check_text(s: str, path: Path, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptFileError(f"{path}: {what} holds a string that is not valid Unicode "
                               f"({s.encode('utf-8', 'backslashreplace').decode()[:60]!r})",
                               hint="names must be valid UTF-8; re-export the file") from None


def read_json(path: Path, walk: bool = True, follow: bool = True, keys: Callable[[Any], int] | None = None) -> Any:
    """Read and parse a JSON file; OSError becomes a one-line error too (``walk``, ``keys``: see
    parse_json_bytes; ``follow``: whether ``path`` may be a symbolic link, see io.paths)."""
    from mocli.io.paths import read_regular

    return parse_json_bytes(read_regular(path, follow), path, walk=walk, keys=keys)
