"""Typed errors. The CLI maps them to exit codes in one place (``mocli.cli``)."""

from __future__ import annotations

import errno
from pathlib import Path

EXIT_FINDINGS = 1
EXIT_UNUSABLE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for tools killed by a closed pipe


class MocliError(Exception):
    """Base class: a message for the user, one line, plus an optional hint."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class InputError(MocliError):
    """The input (path, checkpoint file, option) is unusable: exit 2."""

    exit_code = EXIT_UNUSABLE


class CorruptFileError(InputError):
    """A safetensors or JSON file is malformed."""


class FindingsError(MocliError):
    """Validation or verification produced errors: exit 1 (the report was already rendered)."""

    exit_code = EXIT_FINDINGS


class Refused(FindingsError):
    """validate found errors that make the checkpoint unusable for the command (exit 1)."""

    def __init__(self, findings, verb: str = "convert") -> None:
        first = findings.errors[0]
        super().__init__(
            f"refusing to {verb}: {len(findings.errors)} validation error(s); first: {first.code} {first.location}: "
            f"{first.message}", hint=first.hint or "run mocli validate for the full report")
        self.findings = findings


class Interrupted(MocliError):
    """Ctrl-C: exit 130; the hint says where the resumable partial output is."""

    exit_code = EXIT_INTERRUPTED


class PeerLost(MocliError):
    """Another process of a torchrun world stopped (killed, or failed on its own): this one's collective
    failed through no fault of its own, so its partial output is kept for a resume (exit 130, as stopped
    from outside)."""

    exit_code = EXIT_INTERRUPTED


# errno -> what the user can do about it, for reads and writes alike.
_ERRNO_HINTS = {
    errno.ENOSPC: "the disk is full; free space or write elsewhere, then run the same command again",
    errno.EDQUOT: "the disk quota is exhausted; free space or write elsewhere",
    errno.EROFS: "that file system is read-only; choose a writable location",
    errno.EACCES: "permission denied; check the file's permissions or choose a location you can write",
    errno.EPERM: "operation not permitted there; choose another location",
    errno.ENOENT: "a file or directory is missing, vanished while mocli ran, or is a dangling link",
    errno.EMFILE: "too many open files; raise the limit (ulimit -n)",
    errno.ELOOP: "a symbolic link loops; fix or remove it",
    errno.EIO: "the disk reported an I/O error; copy the file again",
}


def os_error(e: OSError) -> tuple[str, str]:
    """An OSError as a one-line message and a hint (full disk, read-only or vanished paths)."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}", _ERRNO_HINTS.get(e.errno, "check the path and the disk")


def read_error(path: Path, e: OSError) -> CorruptFileError:
    """One-line error for an OSError while reading ``path`` (symlink loops included)."""
    return CorruptFileError(f"{path}: cannot read: {e.strerror or e}", hint=_ERRNO_HINTS.get(e.errno, "check the file"))
