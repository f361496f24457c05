"""Units run ahead of the writer: several at once where there are cores for them, each thread with a
reader of its own, their pieces handed over in plan order; the torch threads they may use; device
results brought to host memory."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mocli.io.safetensors_file import TensorReader
from mocli.stream.pool import UnitContext
from mocli.stream.remote import RemoteUnits
from mocli.stream.units import Piece, Unit

if TYPE_CHECKING:
    import torch


# Torch-free units (every conversion's: FP8 NaN checks and table lookups, row gathers) run this many at
# a time where there are cores for them (numpy drops the GIL in its loops and copies): one per four
# cores, up to four. On the 2-core build machine one, as before: its second core writes and hashes.
# Units still reach the writer in plan order. MOCLI_UNIT_WORKERS overrides (a tuning knob, docs/DEVELOPMENT.md).
UNIT_WORKERS = int(os.environ.get("MOCLI_UNIT_WORKERS") or 0) or max(1, min(4, (os.cpu_count() or 1) // 4))


def ran_in_order(units: list[Unit], ctx: UnitContext, workers: int, remote: RemoteUnits | None = None):
    """(unit, its pieces) in plan order. ``workers`` > 1: up to that many units run at once ahead of the
    writer, each thread with a reader of its own (a reader's descriptors are not shared across threads);
    with ``remote``, those that can run in its worker processes (``mocli.stream.remote``), the threads
    waiting for them. An error stops the units not yet started."""
    if workers == 1:
        for unit in units:
            yield unit, unit.run(ctx)
        return
    import threading
    from collections import deque

    local = threading.local()
    readers: list[TensorReader] = []
    lock = threading.Lock()

    def run(unit: Unit) -> list[Piece]:
        pieces = remote.run(unit) if remote is not None else None
        if pieces is not None:
            return pieces
        own = getattr(local, "ctx", None)
        if own is None:
            with lock:
                readers.append(TensorReader())
                own = local.ctx = UnitContext(readers[-1], None, ctx.pool)
        if remote is None:
            return unit.run(own)
        with remote.here:  # those that run here: no more at once than without workers
            return unit.run(own)

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mocli-unit")
    # units submitted ahead: with worker processes twice the threads, so that a thread whose unit is done
    # takes the next while the writer still waits for an earlier one (units are small: 2.6 MB on average
    # in the bench's Marlin conversion; a worker's output is copied out or kept in its slot, at most
    # as many kept as there are workers: ``mocli.workers.Lease``)
    depth = 2 * workers if remote is not None else workers
    todo = iter(units)
    window: deque = deque()
    try:
        for unit in todo:
            window.append((unit, pool.submit(run, unit)))
            if len(window) >= depth:
                break
        while window:
            unit, fut = window.popleft()
            pieces = fut.result()
            nxt = next(todo, None)
            if nxt is not None:
                window.append((nxt, pool.submit(run, nxt)))
            yield unit, pieces
    finally:
        window.clear()  # units done but not taken: their workers' slots go back (``remote.Held``) to those still running
        pool.shutdown(wait=True, cancel_futures=True)
        for r in readers:
            r.close()


def compute_threads(compute: bool, device: torch.device) -> int:
    """Set torch's intra-op threads for the units; returns the number to restore. The writer and hash
    threads each keep a core busy; intra-op threads beyond the rest only contend with them (measured:
    1 compute thread on 2 cores is 18% faster than 2). A plan with nothing to compute (``compute``:
    the plan's ``Plan.compute``) only re-lays small scales: one thread, and no idle intra-op threads
    spinning against the writers."""
    import torch

    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 2) if compute else 1)
    return threads


def to_host(pieces: list[Piece], ctx: UnitContext) -> list[Piece]:
    """Results leave the device through pooled pinned buffers, so the writer only touches CPU memory."""
    import torch

    out = []
    for p in pieces:
        if isinstance(p.data, torch.Tensor) and p.data.device.type != "cpu":
            host = ctx.buffer(tuple(p.data.shape), p.data.dtype)
            host.copy_(p.data, non_blocking=True)
            out.append(Piece(p.key, p.offset, host))
        else:
            out.append(p)
    torch.cuda.current_stream().synchronize()
    return out
