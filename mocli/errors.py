"""Typed errors. The CLI maps them to exit codes in one place (``mocli.cli.main``)."""

from __future__ import annotations

EXIT_OK = 0
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


class Interrupted(MocliError):
    """Ctrl-C: exit 130; the hint says where the resumable partial output is."""

    exit_code = EXIT_INTERRUPTED


def os_error(e: OSError) -> tuple[str, str]:
    """An OSError as a one-line message and a hint (full disk, read-only or vanished paths)."""
    import errno

    where = f"{e.filename}: " if e.filename else ""
    hints = {
        errno.ENOSPC: "the disk is full; free space or write elsewhere, then run the same command again",
        errno.EDQUOT: "the disk quota is exhausted; free space or write elsewhere",
        errno.EROFS: "that file system is read-only; choose a writable location",
        errno.EACCES: "permission denied; choose a location you can write, or fix its permissions",
        errno.EPERM: "operation not permitted there; choose another location",
        errno.ENOENT: "a file or directory is missing or vanished while mocli ran",
        errno.EMFILE: "too many open files; raise the limit (ulimit -n)",
        errno.ELOOP: "a symbolic link loops; fix or remove it",
    }
    return f"{where}{e.strerror or e}", hints.get(e.errno, "check the path and the disk")
