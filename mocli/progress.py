"""Progress callbacks the commands' core functions call; the CLI implements them. No imports of
note here, so header-only commands stay light."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mocli import trace


def _traced(phase: Callable[[str], None]) -> Callable[[str], None]:
    def both(label: str) -> None:
        trace.mark(label)
        phase(label)

    return both


@dataclass
class Progress:
    """Bytes and units of streaming work, with named phases before it starts."""

    start: Callable[[int, int], None] = lambda total_bytes, total_units: None
    advance: Callable[..., None] = lambda nbytes, units=1, name="": None  # name: the unit just finished
    phase: Callable[[str], None] = lambda label: None

    def __post_init__(self) -> None:
        if trace.ON:
            self.phase = _traced(self.phase)


@dataclass
class ModuleProgress:
    """Modules checked (verify), with named phases before and after."""

    start: Callable[[int], None] = lambda total: None
    advance: Callable[[], None] = lambda: None
    phase: Callable[[str], None] = lambda label: None

    def __post_init__(self) -> None:
        if trace.ON:
            self.phase = _traced(self.phase)
