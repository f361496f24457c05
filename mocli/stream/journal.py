"""The journal of finished units: a re-run with the same fingerprint skips them (Ctrl-C, kill -9)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mocli import __version__

JOURNAL_NAME = ".mocli-journal"
# The source's digests as an interrupted run saw them: a resume must prove it reads the same bytes.
SOURCE_RECORD = ".mocli-source"


def journal_name(proc: int) -> str:
    return JOURNAL_NAME if proc == 0 else f"{JOURNAL_NAME}.{proc}"


def read_journals(partial: Path, fingerprint: str) -> tuple[set[str], dict[str, int]] | None:
    """Units finished by any process of an earlier run with this fingerprint, and per output file
    (relative path) the bytes those units had written (None: not resumable)."""
    done: set[str] = set()
    ends: dict[str, int] = {}
    found = False
    for path in sorted(partial.glob(f"{JOURNAL_NAME}*")):
        try:
            lines = path.read_text().splitlines()
            head = json.loads(lines[0]) if lines else {}
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if not isinstance(head, dict) or head.get("fingerprint") != fingerprint:
            return None
        found = True
        for line in lines[1:]:
            unit, _, marks = line.partition("\t")
            done.add(unit)
            for mark in filter(None, marks.split("\t")):
                rel, _, end = mark.rpartition("=")
                ends[rel] = max(ends.get(rel, 0), int(end))
    return (done, ends) if found else None


def record_source(partial: Path, digests: dict[str, str]) -> None:
    tmp = partial / (SOURCE_RECORD + ".tmp")
    tmp.write_text(json.dumps(digests, sort_keys=True))
    tmp.replace(partial / SOURCE_RECORD)


def recorded_source(partial: Path) -> dict[str, str] | None:
    try:
        data = json.loads((partial / SOURCE_RECORD).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def fingerprint(command: str, source_files: list, layouts: dict, extra: dict[str, Any]) -> str:
    """Identifies a run's output exactly: a journal only resumes a run with the same fingerprint.
    ``source_files``: the source's safetensors headers; ``layouts``: group -> ShardLayout."""
    ident = {"command": command, "mocli": __version__, **extra,
             "source": [(h.path.name, h.size, h.header_sha256) for h in source_files],
             "shards": {g: lay.to_dict() for g, lay in layouts.items()}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
