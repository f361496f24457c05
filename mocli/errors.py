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
