"""Pooled CPU buffers and the context a unit runs in."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from mocli.io.safetensors_file import TensorEntry, TensorReader, tensor_bytes_view, torch_dtypes
from mocli.stream.units import Piece, SourceRange

if TYPE_CHECKING:  # torch-free units (``Unit.torch_free``) run without torch
    import numpy as np
    import torch

# Tensors of at least this many bytes are mapped rather than read on a CPU run (``UnitContext.rows``):
# below it a read costs less than mapping, faulting the pages in and unmapping them.
MAP_MIN = 1 << 20


class Loan:
    """Bytes a torch-free unit's own numpy arrays hold until they are written and hashed: counted
    against the pool's limit as a borrowed buffer is, then forgotten (numpy's allocator owns them;
    nothing goes to the free lists). ``lease``: the worker's slot they lie in (``mocli.stream.remote``),
    given back with them."""

    __slots__ = ("lease", "nbytes")

    def __init__(self, nbytes: int, lease=None) -> None:
        self.nbytes, self.lease = nbytes, lease


class BufferPool:
    """Reusable CPU byte buffers. First-touching fresh pages costs more than copying into warm
    ones (measured 1.3 vs 10 GB/s on the build machines), and units ask for the same sizes again
    and again (one expert after another), so buffers go back to a free list by size.

    ``limit`` bounds the bytes out on loan (and the bytes kept free): a unit asking for more waits
    until the writer and hashing threads give earlier units' buffers back. A unit is never kept
    waiting for its own buffers (``own``), so one larger than the limit still runs."""

    def __init__(self, pin: bool = False, limit: int | None = None) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}
        self.pin, self.limit = pin, limit
        self.out = 0  # bytes on loan
        self.kept = 0  # bytes in the free lists
        self.cond = threading.Condition()  # the writer threads give back what the main thread took

    def _admit(self, nbytes: int, own: int) -> None:
        """Count ``nbytes`` as out once they fit under the limit or nothing but the caller's ``own``
        bytes is out; the caller holds ``cond``."""
        while self.limit and self.out - own > 0 and self.out + nbytes > self.limit:
            self.cond.wait()
        self.out += nbytes

    def take(self, nbytes: int, own: int = 0) -> torch.Tensor:
        with self.cond:
            self._admit(nbytes, own)
            stack = self.free.get(nbytes)
            if stack:
                self.kept -= nbytes
                return stack.pop()
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def lend(self, nbytes: int, own: int = 0, lease=None) -> Loan:
        """Count ``nbytes`` that a unit allocated itself (numpy arrays) as on loan, waiting as ``take``
        does. The arrays exist before the wait, so at most one unit's worth is over the limit."""
        with self.cond:
            self._admit(nbytes, own)
        return Loan(nbytes, lease)

    def give(self, bufs: list[torch.Tensor | Loan]) -> None:
        with self.cond:
            for b in bufs:
                if isinstance(b, Loan):
                    self.out -= b.nbytes
                    if b.lease is not None:
                        b.lease.give()
                    continue
                n = b.numel()
                self.out -= n
                if self.limit is None or self.kept + n <= self.limit:
                    self.free.setdefault(n, []).append(b)
                    self.kept += n
            self.cond.notify_all()


class UnitContext:
    """What a unit may use: a reader, the compute device, and pooled buffers it borrows.

    Buffers a unit borrows go back to the pool once the stream runner has written the unit's pieces.
    ``device`` is None where every unit is torch-free (``Unit.torch_free``): torch is never loaded.
    """

    def __init__(self, reader: TensorReader, device: torch.device | None, pool: BufferPool) -> None:
        self.reader, self.device, self.pool = reader, device, pool
        self.borrowed: list[torch.Tensor] = []
        self.arena = None  # in a worker, the slot its output arrays go to (``mocli.stream.remote``)

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor from the pool, valid until the unit's pieces are written (garbage content)."""
        import torch

        n = dtype.itemsize
        for d in shape:
            n *= d
        buf = self.pool.take(n, own=sum(b.numel() for b in self.borrowed))
        self.borrowed.append(buf)
        return buf.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The entry's tensor in CPU memory: on a CPU run a large tensor is a copy-on-write map of the
        file's pages (``TensorReader.mapped``: nothing read, writes stay private), otherwise it is read
        into a pooled buffer (pinned under CUDA, for the copy to the device)."""
        return self.rows(entry, 0, entry.shape[0] if entry.shape else 1)

    def rows(self, entry: TensorEntry, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of the entry (its first dim; a 0-dim tensor has one row) in CPU memory, as ``read``."""
        dtype = torch_dtypes()[entry.dtype]
        shape = (b - a, *entry.shape[1:]) if entry.shape else ()
        row = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else entry.nbytes
        if self.device.type == "cpu" and (b - a) * row >= MAP_MIN and (entry.start + a * row) % dtype.itemsize == 0:
            mapped = self.reader.mapped(entry, a * row, b * row)
            if mapped is not None:
                return mapped.view(dtype).view(shape)
        t = self.buffer(shape, dtype)
        if b > a and row:
            self.reader.read_range(entry, a * row, tensor_bytes_view(t))
        return t

    def load(self, entry: TensorEntry) -> torch.Tensor:
        """The entry's tensor on the compute device."""
        t = self.read(entry)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    # --- torch-free units (``Unit.torch_free``): numpy uint8 arrays, one row per tensor row ----------

    def array(self, entry: TensorEntry, a: int = 0, b: int | None = None) -> np.ndarray:
        """Rows [a, b) of the entry (its first dim; a 0-dim tensor has one row) as bytes [rows, row bytes]:
        from MAP_MIN bytes a copy-on-write map of the file's pages (nothing read), else read."""
        import numpy as np

        rows = entry.shape[0] if entry.shape else 1
        b = rows if b is None else b
        row = entry.nbytes // rows if rows else 0
        if (b - a) * row >= MAP_MIN:
            mapped = self.reader.mapped_array(entry, a * row, b * row)
            if mapped is not None:
                return mapped.reshape(b - a, row)
        out = np.empty((b - a, row), dtype=np.uint8)
        if out.size:
            self.reader.read_range(entry, a * row, memoryview(out.reshape(-1)))
        return out

    def gather_array(self, parts: list[tuple[TensorEntry, int, int]], idx: np.ndarray) -> np.ndarray:
        """``concatenate([rows a:b of each entry])[idx]`` as bytes [len(idx), row bytes], for entries of
        one row size, gathered from their maps (``array``) without the concatenation
        (``ops.nvfp4.gather_rows``)."""
        from mocli.ops.nvfp4 import gather_rows

        return gather_rows([self.array(e, a, b) for e, a, b in parts], idx)

    def empty(self, shape: tuple[int, ...], dtype="u1") -> np.ndarray:
        """An output array of a torch-free unit: in a worker, room in its slot where the unit's pieces
        are handed over from (``mocli.stream.remote``: not copied there); else numpy's own."""
        import numpy as np

        got = self.arena.empty(shape, dtype) if self.arena is not None else None
        return np.empty(shape, dtype=dtype) if got is None else got

    @staticmethod
    def src(entry: TensorEntry) -> SourceRange:
        return SourceRange(entry, 0, entry.nbytes)

    def release(self, pieces: list[Piece]) -> list[torch.Tensor | Loan]:
        """Hand over the buffers the unit's pieces still point into (they go back to the pool once
        written); the rest - inputs already consumed, on CUDA everything read and copied to the device
        once the stream is synchronized - go back to the pool now. Half the bytes a quantize unit
        borrowed, were its inputs, held until the writer was done. A torch-free unit's numpy pieces
        are lent (``BufferPool.lend``): the writer lanes' and hashing threads' queues would otherwise
        let several units' arrays pile up behind a slow disk, beyond the pool's limit."""
        import numpy as np

        keep: list[torch.Tensor | Loan] = []
        if self.borrowed:
            import torch

            held = {p.data.untyped_storage().data_ptr() for p in pieces
                    if isinstance(p.data, torch.Tensor) and p.data.device.type == "cpu"}
            keep = [b for b in self.borrowed if b.untyped_storage().data_ptr() in held]
            done = [b for b in self.borrowed if b.untyped_storage().data_ptr() not in held]
            self.borrowed = []
            if done:
                self.pool.give(done)
        arrays = sum(p.data.nbytes for p in pieces if isinstance(p.data, np.ndarray))
        lease = getattr(pieces, "lease", None)  # a worker's slot the arrays are views of
        if arrays:  # after the give-back above, and never waiting for the unit's own kept buffers
            keep.append(self.pool.lend(arrays, own=sum(b.numel() for b in keep), lease=lease))
        elif lease is not None:
            lease.give()
        return keep
