"""Torch-free units run in worker processes (``mocli.workers``), their pieces handed back to the writer here.

A stream forks its workers once the plan exists, so a child finds every unit where the parent has it
(``_UNITS``) and is told only an index. It runs the unit with a reader of its own, its output arrays
allocated in its slot (``UnitContext.empty``; any other array is copied there), and replies with where
each piece lies (source ranges travel as they are). The parent's pieces are views of the slot, which
stays theirs until they are written and hashed (``Held``, ``mocli.workers.Lease``: the loan that
``UnitContext.release`` makes of them gives it back), so neither side copies a unit's bytes. The writer,
the hashing, the journal and the checks see no difference. A unit that fails in a worker (bad data, a
worker gone, output larger than a slot) runs again here, where its error shows as it always has: a
unit's bytes are the same wherever it ran.
"""

from __future__ import annotations

import pickle
import threading
from typing import TYPE_CHECKING

from mocli import workers as wk
from mocli.stream.units import Piece, SourceRange, Unit

if TYPE_CHECKING:
    import numpy as np

    from mocli.stream.pool import UnitContext

_ALIGN = 64
_UNITS: list[Unit] = []  # the stream's units, as the children inherit them
_ctx: UnitContext | None = None  # a child's own context (its reader)


class RemoteUnits:
    """The workers of one stream: ``run(unit)`` returns its pieces, or None where it is to run here."""

    def __init__(self, units: list[Unit], procs: int, here: int) -> None:
        global _UNITS
        self.here = threading.Semaphore(here)  # units that run in this process, at once
        # a torch-free unit goes to a worker where its input fits a slot: its output is about as large
        # (the byte moves keep sizes; one that writes more than a slot runs again here)
        _UNITS = units
        self.pool = wk.fresh(procs, spare=procs)  # as many units kept for the writer as are at work
        self.index = {id(u): i for i, u in enumerate(units) if u.torch_free and 0 < u.input_bytes <= 2 * wk.SLOT} \
            if self.pool is not None else {}

    def close(self) -> None:
        global _UNITS
        if self.pool is not None:
            self.pool.close()
        _UNITS = []

    def run(self, unit: Unit) -> list[Piece] | None:
        i = self.index.get(id(unit))
        if i is None or self.pool is None:
            return None
        got: list[Held] = []

        def keep(lease: wk.Lease | None) -> None:
            if lease is None:  # the slot is reused: the arrays copied out
                got[0] = Held(p if isinstance(p.data, SourceRange) else Piece(p.key, p.offset, p.data.copy()) for p in got[0])
                return
            got[0].lease = lease

        task = wk.Task(run_unit, (i,), 0, 2 * wk.SLOT, None, lambda slot, reply: got.append(_pieces(slot, reply)), keep=keep)
        return got[0] if self.pool.call(task) else None


class Held(list):
    """A unit's pieces that are views of a worker's slot, and the ``lease`` that keeps it theirs: a step
    between the unit and ``UnitContext.release`` that made a new list of them would lose it (none does;
    ``unit_runner.to_host`` is for units on a GPU, which never run in a worker)."""

    lease: wk.Lease | None = None


class _Arena:
    """A worker's slot handed out to one unit's output arrays, front to back (``UnitContext.empty``)."""

    def __init__(self, slot: np.ndarray) -> None:
        self.slot, self.at = slot, 0
        self.base = slot.__array_interface__["data"][0]

    def take(self, nbytes: int) -> int | None:
        """Where ``nbytes`` fit in the slot (aligned), or None where they do not."""
        at = self.at
        if at + nbytes > self.slot.size:
            return None
        self.at = at + -(-nbytes // _ALIGN) * _ALIGN
        return at

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray | None:
        import numpy as np

        dtype = np.dtype(dtype)
        at = self.take(dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
        return None if at is None else _view(self.slot, at, dtype, shape)

    def where(self, a: np.ndarray) -> int | None:
        """The offset in the slot of an array laid out there whole (C order), else None."""
        at = a.__array_interface__["data"][0] - self.base
        return at if a.flags.c_contiguous and 0 <= at and at + a.nbytes <= self.slot.size else None


def run_unit(src: np.ndarray, dst: np.ndarray, args: tuple[int, ...]) -> bytes:
    """In a worker: unit ``args[0]`` of the stream, its arrays laid out in ``dst``; the reply lists each
    piece as (key, offset, a source range) or (key, offset, (dtype, shape, where in the slot))."""
    global _ctx
    import numpy as np

    if _ctx is None:
        from mocli.io.safetensors_file import TensorReader
        from mocli.stream.pool import BufferPool, UnitContext

        _ctx = UnitContext(TensorReader(), None, BufferPool())
    _ctx.arena = arena = _Arena(dst)
    try:
        pieces = _UNITS[args[0]].run(_ctx)
    finally:
        _ctx.arena = None
    out = []
    for p in pieces:
        if isinstance(p.data, SourceRange):
            out.append((p.key, p.offset, p.data))
            continue
        if not isinstance(p.data, np.ndarray):
            raise ValueError("not a numpy piece")  # the parent runs it instead
        at = arena.where(p.data)
        if at is None:  # an array of the unit's own: copied in after the others
            at = arena.take(p.data.nbytes)
            if at is None:
                raise ValueError("past the slot")
            np.copyto(_view(dst, at, p.data.dtype, p.data.shape), p.data)
        out.append((p.key, p.offset, (p.data.dtype.str, p.data.shape, at)))
    return pickle.dumps(out)


def _pieces(slot: np.ndarray, reply: bytes) -> Held:
    """The parent's pieces from a worker's reply: views of its slot."""
    import numpy as np

    out = Held()
    for key, offset, data in pickle.loads(reply):
        if isinstance(data, SourceRange):
            out.append(Piece(key, offset, data))
            continue
        dtype, shape, at = data
        out.append(Piece(key, offset, _view(slot, at, np.dtype(dtype), shape)))
    return out


def _view(slot: np.ndarray, at: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The array of ``dtype`` and ``shape`` that lies at byte ``at`` of a slot (uint8)."""
    import numpy as np

    return slot[at:at + dtype.itemsize * int(np.prod(shape, dtype=np.int64))].view(dtype).reshape(shape)
