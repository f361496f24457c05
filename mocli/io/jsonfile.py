"""JSON from files we do not control: parse errors, nesting and invalid text become one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mocli.errors import CorruptFileError

# No checkpoint file nests anywhere near this deep; deeper input is hostile or broken, and would
# otherwise surface later as a RecursionError in whatever walks it.
MAX_DEPTH = 64
# A lone UTF-16 surrogate can only enter through a \uD800-\uDFFF escape (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_bytes(raw: bytes, path: Path, what: str = "file", walk: bool = True) -> Any:
    """json.loads with the failures of hostile input turned into CorruptFileError naming ``path``.

    ``walk=False`` (safetensors headers, whose fixed structure the caller checks entry by entry)
    skips the depth walk; strings are still checked whenever the text holds a surrogate escape."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: {what} is not valid JSON ({e})",
                               hint="the file is corrupt or truncated; re-export or download it again") from None
    except RecursionError:
        raise CorruptFileError(f"{path}: {what} nests JSON too deeply to read",
                               hint="the file is corrupt or hostile; re-export or download it again") from None
    suspicious = b"\\u" in raw and bool(_SURROGATE_ESCAPE.search(raw))  # plain search first: escapes are rare
    if walk or suspicious:
        _check_tree(data, path, what, check_text=suspicious)
    return data


def _check_tree(data: Any, path: Path, what: str, check_text: bool) -> None:
    """Depth limit always; strings only when the raw text had a surrogate escape (fast path)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CorruptFileError(f"{path}: {what} nests JSON deeper than {MAX_DEPTH} levels",
                                   hint="the file is corrupt or hostile; re-export or download it again")
        if isinstance(node, dict):
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


def _check_text(s: str, path: Path, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptFileError(f"{path}: {what} holds a string that is not valid Unicode "
                               f"({s.encode('utf-8', 'backslashreplace').decode()[:60]!r})",
                               hint="names must be valid UTF-8; re-export the file") from None


def read_json(path: Path, walk: bool = True, follow: bool = True) -> Any:
    """Read and parse a JSON file; OSError becomes a one-line error too (``walk``: see parse_json_bytes;
    ``follow``: whether ``path`` may be a symbolic link, see io.paths)."""
    from mocli.io.paths import read_regular

    return parse_json_bytes(read_regular(path, follow), path, walk=walk)
