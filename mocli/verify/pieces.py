"""An MoE layer's check in pieces, over worker processes (``mocli.workers``), where the workers outnumber
the run's large MoE layers.

With one worker per module, a machine of many cores checked the H200 bench's six MoE layers on six of its
fourteen workers, each layer's expert bytes (its Marlin decode: byte moves that hold the GIL between short
passes) the long pole: ~1.2 s each, while eight workers idled. So here ``check_moe`` runs in this process
(loading, consistency, merging: light) and sends out the heavy parts: the expert bytes in runs of
consecutive experts, and the numerics on sampled experts, each a task of its own.

A piece is a module-level function and its arguments, pickled into the task's slot; a worker forked once
the run's context exists (``_CTX``) runs it there and pickles its answer back. A piece that fails in a
worker (an error, the worker gone) runs again here, where what it raises is what a check in one process
raises: a run of experts that meets a layout fault fails in the worker on purpose, so that the fault this
process reports is its own exception.
"""

from __future__ import annotations

import heapq
import pickle
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mocli import trace
from mocli import workers as wk
from mocli.verify.kinds import each_expert, merged
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.moe import MoeCase, case_numbers, rank_view

# The run's context and how a process gives back its mapped pages, as the workers inherit them
_CTX: CheckContext | None = None
_DROP: Callable[[], None] | None = None


def parts_for(procs: int, large: int) -> int:
    """Runs of experts per layer and rank, none where the workers do not outnumber the large layers
    (``large``) twice: about three tasks per worker in all, so that the last to finish end close together
    (with 18 runs for the H200 bench's six layers on 14 workers, the last two layers' runs started as
    the first wave ended, 0.5 s later)."""
    return -(-3 * procs // large) if large and procs >= 2 * large else 1


class Pieces:
    """``check_moe``'s heavy parts in ``pool``'s workers (``start``), the numerics first.

    Each piece waits in ``pending``; a thread per piece asks the pool for a worker, and the piece that
    worker runs is chosen only once it has one (the task's ``fill``): the numerics of any layer before any
    run of expert bytes, then in the order they came. Chosen when sent instead, the order was whichever
    thread the pool's queue woke: on the H200 bench the numerics of three layers (their longest pieces)
    started last and ran alone for the last 0.4 s of 1.7."""

    def __init__(self, pool: wk.Workers, procs: int, parts: int, here: threading.Semaphore) -> None:
        self.pool, self.parts, self.here = pool, parts, here
        self.threads = ThreadPoolExecutor(max_workers=2 * procs, thread_name_prefix="mocli-verify-piece")
        self.pending: list[tuple[int, int, Callable, tuple, Future]] = []  # a heap: (0 numerics / 1 bytes, order sent, fn, args, answer)
        self.lock = threading.Lock()
        self.order = 0

    def start(self, case: MoeCase, case_of: type[MoeCase], rank: int, mod, experts: list,
              i_slice: tuple[int, int]) -> tuple[_Later, Future]:
        """A rank's numerics and its expert bytes in ``parts`` runs, sent out now: (the bytes merged as one
        loop over the experts has them, the numerics), each a future."""
        numbers = self.call(numbers_of, (case_of, case.name, rank), first=True)
        per = -(-len(experts) // self.parts)
        runs = [self.call(expert_run, (case_of, case.name, rank, lo, min(lo + per, len(experts))))
                for lo in range(0, len(experts), per)]

        def merge() -> tuple:
            found, fault, got = merged([f.result() for f in runs])
            return case.bytes_found(mod, found, fault, got)

        return _Later(merge), numbers

    def call(self, fn: Callable, args: tuple, first: bool = False) -> Future:
        answer: Future = Future()
        with self.lock:
            heapq.heappush(self.pending, (0 if first else 1, self.order, fn, args, answer))
            self.order += 1
        self.threads.submit(self._run)
        return answer

    def _take(self) -> tuple[Callable, tuple, Future]:
        with self.lock:
            return heapq.heappop(self.pending)[2:]

    def _run(self) -> None:
        """One piece (the first pending once a worker is free) in that worker, or here where it failed there."""
        chosen: list = []
        got: list[bytes] = []

        def fill(slot) -> None:
            chosen.append(self._take())
            blob = pickle.dumps(chosen[0][:2])
            slot[:8 + len(blob)] = memoryview(struct.pack("<q", len(blob)) + blob)

        try:
            done = self.pool.call(wk.Task(run_piece, (), wk.SLOT, 0, fill, lambda _, reply: got.append(reply)))
        except Exception:  # noqa: BLE001 - the piece could not be sent (never: a few names and numbers)
            done = False
        except BaseException as e:  # Ctrl-C while it was out: whoever waits on the piece is told
            (chosen[0] if chosen else self._take())[2].set_exception(e)
            raise
        fn, args, answer = chosen[0] if chosen else self._take()
        if not answer.set_running_or_notify_cancel():
            return
        try:
            answer.set_result(pickle.loads(got[0]) if done else self._here(fn, args))
        except BaseException as e:  # noqa: BLE001 - the piece's own error, for whoever waits on it
            answer.set_exception(e)

    def _here(self, fn: Callable, args: tuple) -> Any:
        with self.here:  # failed there: here, where its error shows
            return fn(*args)

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)
        with self.lock:
            left, self.pending = self.pending, []
        for *_, answer in left:  # never sent (an error or Ctrl-C cancelled their threads)
            answer.cancel()


class _Later:
    """A result made by the first ``result()`` call, in its caller's thread (``take_bytes`` asks for it)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def result(self) -> Any:
        return self.make()


def inherit(ctx: CheckContext, drop: Callable[[], None]) -> None:
    """What the workers forked next see (and this process, where a piece runs again): the run's context."""
    global _CTX, _DROP
    _CTX, _DROP = ctx, drop


def run_piece(src, dst, args: tuple[int, ...]) -> bytes:
    """In a worker: the piece pickled in ``src`` (its length first), its answer pickled; its mapped pages
    given back after."""
    (n,) = struct.unpack("<q", src[:8].tobytes())
    fn, fargs = pickle.loads(src[8:8 + n].tobytes())
    try:
        return pickle.dumps(fn(*fargs))
    finally:
        if _DROP is not None:
            _DROP()


def _view(case_of: type[MoeCase], name: str, rank: int) -> tuple[MoeCase, Any, int, tuple[int, int], list]:
    case, ck = case_of(name, _CTX), _CTX.cks[rank]
    return (case, *rank_view(case, ck, ck.module_entry(name)))


def expert_run(case_of: type[MoeCase], name: str, rank: int, lo: int, hi: int) -> tuple:
    """Experts [lo, hi) of a layer's rank, as ``each_expert`` answers; a layout fault in a worker raised
    (the run goes again in the parent, which reports it)."""
    case, mod, _, i_slice, experts = _view(case_of, name, rank)
    trace.mark(f"{name}: experts {lo}-{hi - 1} of rank {rank}")
    found, fault, got = each_expert(experts[lo:hi], case.expert_bytes(mod, i_slice), case.errors, first=lo)
    trace.mark(f"{name}: experts {lo}-{hi - 1} of rank {rank} done")
    if fault is not None and wk.in_worker():
        raise fault
    return found, fault, got


def numbers_of(case_of: type[MoeCase], name: str, rank: int) -> tuple:
    """A layer's numerics on one rank (``MoeCase.numbers``)."""
    case, mod, off, i_slice, _ = _view(case_of, name, rank)
    trace.mark(f"{name}: numerics of rank {rank} started")
    try:
        return case_numbers(case, _CTX.cks[rank], mod, off, i_slice)
    finally:
        trace.mark(f"{name}: numerics of rank {rank} done")
