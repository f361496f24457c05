"""Torch-free units run in worker processes (``mocli.workers``), their pieces handed back to the writer here.

A stream forks its workers once the plan exists, so a child finds every unit where the parent has it
(``_UNITS``) and is told only an index. It runs the unit with a reader of its own, lays the pieces'
arrays end to end in its slot and replies with where each went (source ranges travel as they are). The
parent copies them out into arrays of its own (a slot is reused at once) and hands them on as if the unit
had run here: the writer, the hashing, the journal and the checks see no difference. A unit that fails
in a worker (bad data, a worker gone, output larger than a slot) runs again here, where its error shows as
it always has: a unit's bytes are the same wherever it ran.
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
        self.pool = wk.fresh(procs)
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
        got: list[list[Piece]] = []
        task = wk.Task(run_unit, (i,), 0, 2 * wk.SLOT, None, lambda slot, reply: got.append(_pieces(slot, reply)))
        return got[0] if self.pool.call(task) else None


def run_unit(src: np.ndarray, dst: np.ndarray, args: tuple[int, ...]) -> bytes:
    """In a worker: unit ``args[0]`` of the stream, its arrays laid out in ``dst``; the reply lists each
    piece as (key, offset, a source range) or (key, offset, (dtype, shape, where in the slot))."""
    global _ctx
    import numpy as np

    if _ctx is None:
        from mocli.io.safetensors_file import TensorReader
        from mocli.stream.pool import BufferPool, UnitContext

        _ctx = UnitContext(TensorReader(), None, BufferPool())
    out, at = [], 0
    for p in _UNITS[args[0]].run(_ctx):
        if isinstance(p.data, SourceRange):
            out.append((p.key, p.offset, p.data))
            continue
        if not isinstance(p.data, np.ndarray) or at + p.data.nbytes > dst.size:
            raise ValueError("not a numpy piece, or past the slot")  # the parent runs it instead
        np.copyto(dst[at:at + p.data.nbytes].view(p.data.dtype).reshape(p.data.shape), p.data)
        out.append((p.key, p.offset, (p.data.dtype.str, p.data.shape, at)))
        at += -(-p.data.nbytes // _ALIGN) * _ALIGN
    return pickle.dumps(out)


def _pieces(slot: np.ndarray, reply: bytes) -> list[Piece]:
    """The parent's pieces from a worker's reply: arrays copied out of its slot."""
    import numpy as np

    out = []
    for key, offset, data in pickle.loads(reply):
        if isinstance(data, SourceRange):
            out.append(Piece(key, offset, data))
            continue
        dtype, shape, at = data
        arr = np.empty(shape, dtype=np.dtype(dtype))
        np.copyto(arr.reshape(-1).view(np.uint8), slot[at:at + arr.nbytes])
        out.append(Piece(key, offset, arr))
    return out
