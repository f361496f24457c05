"""The one output sink: data on stdout (human tables or --json), everything else on stderr."""

from __future__ import annotations

import json
import re
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


# Spaces (and tabs) at the end of a line, before any closing style codes
_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)(?=\n)")


class _Console(Console):
    """rich exits 1 on a broken pipe by itself; hand it to mocli.cli's one error handler instead.
    Off a terminal, rich would wrap at 80 columns: it wraps nothing unless COLUMNS says so; and it pads
    each line of a table (a grid's last column, a title) to the table's width: a pipe or a file gets no
    trailing whitespace (``mocli inspect M | diff``, a CI log). No ``:name:`` emoji codes: a tensor name
    between colons is printed as it is (and rich's 20 ms table of codes is never loaded)."""

    def __init__(self, file, **kw) -> None:
        import os

        if not _isatty(file) and not os.environ.get("COLUMNS"):
            kw.setdefault("width", _UNWRAPPED)
        super().__init__(file=file, **kw)

    def _render_buffer(self, buffer) -> str:
        text = super()._render_buffer(buffer)
        return text if self.is_terminal else _TRAILING.sub(r"\1", text)

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
    emitted: bool = False  # the command's result is on stdout
    _stdout: Console | None = field(default=None, repr=False)
    _stderr: Console | None = field(default=None, repr=False)

    @property
    def stdout(self) -> Console:
        if self._stdout is None:
            self._stdout = _Console(file=sys.stdout, highlight=False, soft_wrap=False, emoji=False)
        return self._stdout

    @property
    def stderr(self) -> Console:
        if self._stderr is None:
            self._stderr = _Console(file=sys.stderr, highlight=False, emoji=False)
        return self._stderr

    @property
    def show_progress(self) -> bool:
        # Bars only where someone watches: a log file or a pipe gets the result and no redraws.
        return not (self.json or self.quiet) and self.stderr.is_terminal

    def emit(self, data: dict[str, Any], render: Callable[[dict[str, Any], Output], None]) -> None:
        """The command's result: JSON on stdout, or the human rendering."""
        self.emitted = True
        if self.json:
            sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
            sys.stdout.flush()
        else:
            render(data, self)

    @property
    def log_progress(self) -> bool:
        """Plain progress lines where no terminal watches (a CI log, a pipe): a long run is never silent."""
        import os

        return not (self.json or self.quiet) and not self.stderr.is_terminal and int(os.environ.get("RANK", "0")) == 0

    @contextmanager
    def progress_bar(self, label: str) -> Iterator[Any]:
        """A mocli.progress.Progress on stderr: a rich bar (phase, bytes, units, rate, ETA) on a terminal,
        plain lines elsewhere (``ProgressLines``); silent in JSON/quiet mode and in every torchrun process
        but the first."""
        import os

        from mocli.progress import Progress as Sink

        if self.log_progress:
            lines = ProgressLines(self.stderr, label)
            yield Sink(start=lines.start, advance=lines.advance, phase=lines.phase)
            return
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
        )

        bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                       _rate_column(), TextColumn("{task.fields[units]}"), TimeRemainingColumn(),
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

        def advance(nbytes: int, units: int = 1, name: str = "") -> None:
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
        """A mocli.progress.ModuleProgress: a rich bar over modules on a terminal, plain lines elsewhere."""
        from mocli.progress import ModuleProgress as Sink

        if self.log_progress:
            lines = ProgressLines(self.stderr, label, what="modules")
            yield Sink(start=lambda total: lines.start(0, total), advance=lambda: lines.advance(0), phase=lines.phase)
            return
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

    def fail(self, message: str, hint: str | None, exit_code: int) -> None:
        """The command's error: one line on stderr, and with --json an object on stdout (unless the
        command already printed its result there: stdout stays one JSON document)."""
        self.error(message, hint)
        if self.json and not self.emitted:
            sys.stdout.write(json.dumps({"error": {"message": message, "hint": hint, "exit_code": exit_code}}) + "\n")
            sys.stdout.flush()

    def info(self, message: str) -> None:
        if not self.quiet:
            self.stderr.print(message, soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            self.stderr.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


class ProgressLines:
    """Progress as plain lines for logs (pip and huggingface_hub print lines there too): one per phase,
    then at most every ``MOCLI_PROGRESS_SECONDS`` (10) seconds and at every tenth of the work, with the
    unit last finished, bytes (binary units, as the summaries), rate and ETA. Nothing during the first
    ``every / 5`` seconds: a command that is done by then leaves only its result in the log."""

    def __init__(self, console: Console, label: str, what: str = "units") -> None:
        import os
        import time

        self.console, self.label, self.what, self.clock = console, label, what, time.monotonic
        self.every = float(os.environ.get("MOCLI_PROGRESS_SECONDS", "10"))
        self.quiet_until = self.clock() + self.every / 5
        self.t0 = self.last = self.clock()
        self.total_bytes = self.done_bytes = self.total_units = self.done_units = 0
        self.tenth = 0
        self.last_phase = ""

    def _print(self, text: str) -> None:
        if self.clock() < self.quiet_until:
            return
        self.console.print(f"{self.label}: {escape(text)}", soft_wrap=True, highlight=False, markup=True)

    def phase(self, text: str) -> None:
        if text and text != self.last_phase:
            self.last_phase = text
            self._print(text)

    def start(self, total_bytes: int, total_units: int) -> None:
        from mocli.io import human_bytes

        self.total_bytes, self.total_units = total_bytes, total_units
        self.t0 = self.last = self.clock()
        size = f"{human_bytes(total_bytes)} in " if total_bytes else ""
        self._print(f"{size}{total_units} {self.what}")

    def advance(self, nbytes: int, units: int = 1, name: str = "") -> None:
        from mocli.io import human_bytes

        self.done_bytes += nbytes
        self.done_units += units
        frac = (self.done_bytes / self.total_bytes if self.total_bytes else
                self.done_units / self.total_units if self.total_units else 1.0)
        now = self.clock()
        tenth = int(frac * 10)
        if now - self.last < self.every and tenth == self.tenth:
            return
        self.last, self.tenth = now, tenth
        elapsed = max(now - self.t0, 1e-9)
        parts = [f"{frac:.0%}"]
        if self.total_bytes:
            parts.append(f"{human_bytes(self.done_bytes)} of {human_bytes(self.total_bytes)}, "
                         f"{human_bytes(self.done_bytes / elapsed)}/s")
        parts.append(f"{self.done_units}/{self.total_units} {self.what}")
        if 0 < frac < 1:
            parts.append(f"ETA {elapsed * (1 - frac) / frac:.0f} s")
        self._print(", ".join(parts) + (f" ({name})" if name else ""))


def _rate_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    from mocli.io import human_bytes

    class Rate(ProgressColumn):
        """Transfer rate in binary units, as every size mocli prints (rich's own column is decimal)."""

        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{human_bytes(speed)}/s" if speed else "?", style="progress.data.speed")

    return Rate()
