"""Work done aside: in a forked child on another core while this process goes on.

The header-only commands are one Python thread; on the 2-core build VM the second core sat idle while
``validate --target marlin`` read 62 headers and then planned the conversion (0.45 s and 0.6 s of its
~2.2). A child forked at the right moment shares everything built so far (copy on write), does its part
and sends back bytes (marshal or pickle, the caller's choice); the parent does the rest meanwhile.

The child's answer is an optimisation, never the authority: where the child fails (an exception, a
crash, a signal) ``result`` is None and the caller does the work itself, so every error a user sees is
raised by the parent, in the order a serial run raises it. Nothing is forked where that is unsafe or
worthless: one core, other Python threads running (a lock one holds would stay locked in the child), torch
loaded (its thread pools), or ``ENABLED`` off (tests compare both paths; ``MOCLI_SERIAL=1`` for users).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mocli.trace import mark

ENABLED = not os.environ.get("MOCLI_SERIAL")


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Child:
    """A forked child's work: ``result()`` waits for it."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd, self.done = pid, fd, False

    def result(self) -> bytes | None:
        """What the child sent, or None where it did not finish its work."""
        try:
            with os.fdopen(self.fd, "rb") as f:
                data = f.read()
        finally:
            self.done = True
            _, status = os.waitpid(self.pid, 0)
        return data if os.waitstatus_to_exitcode(status) == 0 else None

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            os.close(self.fd)
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


@contextmanager
def aside(work: Callable[[], bytes]) -> Iterator[Child | None]:
    """``work()`` in a forked child (its bytes by ``Child.result``), or None where nothing was forked: the
    caller then does the work itself. A child still running when the block ends (an error in the parent)
    is killed and reaped."""
    job = _fork(work) if _worth_it() else None
    try:
        yield job
    finally:
        if job is not None:
            job.cancel()


def _worth_it() -> bool:
    return (ENABLED and hasattr(os, "fork") and cores() > 1 and threading.active_count() == 1
            and "torch" not in sys.modules)


def _fork(work: Callable[[], bytes]) -> Child | None:
    read, write = os.pipe()
    try:
        with warnings.catch_warnings():  # 3.12 warns of native threads (numpy's BLAS pool): the child uses none
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:  # no process to spare: the caller does the work
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the child: never returns, never runs the parent's exit handlers or flushes its buffers
        code = 1
        try:
            os.close(read)
            data = work()
            with os.fdopen(write, "wb") as f:
                f.write(data)
            code = 0
        except BaseException:  # noqa: BLE001 - the parent does the work again and raises what is wrong
            pass
        finally:
            os._exit(code)
    os.close(write)
    mark(f"aside: child {pid} forked")
    return Child(pid, read)
