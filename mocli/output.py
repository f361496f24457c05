"""The one output sink: data on stdout (human tables or --json), everything else on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape

# Width of a console that is not a terminal: no line is ever wrapped (a log or a grep reads each
# finding and summary as one line, as ruff's and pip's output reads); tables take their natural width.
_UNWRAPPED = 1 << 20


class _Console(Console):
    """rich exits 1 on a broken pipe by itself; hand it to mocli.cli's one error handler instead.
    Off a terminal, rich would wrap at 80 columns: it wraps nothing unless COLUMNS says so."""

    def __init__(self, file, **kw) -> None:
        import os

        if not _isatty(file) and not os.environ.get("COLUMNS"):
            kw.setdefault("width", _UNWRAPPED)
        super().__init__(file=file, **kw)

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def _isatty(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, set | frozenset | tuple):
        return list(o)
    return str(o)


@dataclass
class Output:
    json: bool = False
    quiet: bool = False
    verbose: int = 0
    _stdout: Console | None = field(default=None, repr=False)
    _stderr: Console | None = field(default=None, repr=False)

    @property
    def stdout(self) -> Console:
        if self._stdout is None:
            self._stdout = _Console(file=sys.stdout, highlight=False, soft_wrap=False)
        return self._stdout

    @property
    def stderr(self) -> Console:
        if self._stderr is None:
            self._stderr = _Console(file=sys.stderr, highlight=False)
        return self._stderr

    @property
    def show_progress(self) -> bool:
        # Bars only where someone watches: a log file or a pipe gets the result and no redraws.
        return not (self.json or self.quiet) and self.stderr.is_terminal

    def emit(self, data: dict[str, Any], render: Callable[[dict[str, Any], Output], None]) -> None:
        """The command's result: JSON on stdout, or the human rendering."""
        if self.json:
            sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
            sys.stdout.flush()
        else:
            render(data, self)

    @contextmanager
    def progress_bar(self, label: str) -> Iterator[Any]:
        """A mocli.progress.Progress driving a rich bar on stderr (phase, bytes, units, ETA); silent in
        JSON/quiet mode and in every torchrun process but the first."""
        import os

        from mocli.progress import Progress as Sink

        if not self.show_progress or int(os.environ.get("RANK", "0")) != 0:
            yield Sink()
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                       TransferSpeedColumn(), TextColumn("{task.fields[units]}"), TimeRemainingColumn(),
                       console=self.stderr, transient=True)
        state: dict[str, Any] = {"task": None, "done": 0, "total": 0}

        # The bar starts on first use: a command that reports nothing leaves stderr untouched.
        def phase(text: str) -> None:
            if state["task"] is None:
                bar.start()
                state["task"] = bar.add_task(f"{label}: {text}", total=None, units="")
            else:
                bar.update(state["task"], description=f"{label}: {text}")

        def start(total_bytes: int, total_units: int) -> None:
            phase("")
            state.update(done=0, total=total_units)
            bar.update(state["task"], description=label, total=total_bytes, completed=0,
                       units=f"0/{total_units} units")

        def advance(nbytes: int, units: int = 1) -> None:
            if state["task"] is not None:
                state["done"] += units
                bar.update(state["task"], advance=nbytes, units=f"{state['done']}/{state['total']} units")

        try:
            yield Sink(start=start, advance=advance, phase=phase)
        finally:
            if state["task"] is not None:
                bar.stop()

    @contextmanager
    def module_progress(self, label: str) -> Iterator[Any]:
        """A mocli.progress.ModuleProgress driving a rich bar over modules on stderr, with phases before it."""
        from mocli.progress import ModuleProgress as Sink

        if not self.show_progress:
            yield Sink()
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeRemainingColumn(), console=self.stderr, transient=True)
        state: dict[str, Any] = {"task": None}

        def phase(text: str) -> None:
            if state["task"] is None:
                bar.start()
                state["task"] = bar.add_task(f"{label}: {text}", total=None)
            else:
                bar.update(state["task"], description=f"{label}: {text}")

        def start(total: int) -> None:
            phase("modules")
            bar.update(state["task"], total=total, completed=0)

        try:
            yield Sink(start=start, advance=lambda: bar.advance(state["task"]) if state["task"] is not None else None,
                       phase=phase)
        finally:
            if state["task"] is not None:
                bar.stop()

    def error(self, message: str, hint: str | None = None) -> None:
        line = f"[bold red]error:[/] {escape(message)}"
        if hint:
            line += f" [dim](hint: {escape(hint)})[/]"
        self.stderr.print(line, soft_wrap=True)

    def info(self, message: str) -> None:
        if not self.quiet:
            self.stderr.print(message, soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            self.stderr.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)
