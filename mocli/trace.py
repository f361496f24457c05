"""``MOCLI_TRACE=1``: one stderr line per phase, in seconds since the process started (interpreter
start-up included), so a slow whole-process figure can be taken apart on the machine that measured it.
Off by default; costs one environment lookup."""

from __future__ import annotations

import atexit
import os
import time

ON = bool(os.environ.get("MOCLI_TRACE"))


def _exec_time() -> float:
    """CLOCK_BOOTTIME at this process's start (a forked worker keeps its parent's: one time line)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.clock_gettime(time.CLOCK_BOOTTIME) - time.perf_counter()


_START = _exec_time() if ON else 0.0


def mark(label: str) -> None:
    """One whole line in one ``write(2)``: ``print`` writes the text and its newline apart, so marks from the
    threads that hash, convert and verify in parallel ran together on one line; and no lock, which a worker
    forked while another thread held it would wait on for ever."""
    if ON:
        os.write(2, f"[trace] {time.clock_gettime(time.CLOCK_BOOTTIME) - _START:7.3f} s  {label}\n".encode())


_ONCE: set[str] = set()


def once(label: str) -> None:
    """``mark`` the first time only (a loop's first pass)."""
    if ON and label not in _ONCE:
        _ONCE.add(label)
        mark(label)


if ON:
    atexit.register(mark, "exit (atexit handlers run)")
