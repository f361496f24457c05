"""Pooled CPU buffers and the context a unit runs in."""

from __future__ import annotations

import threading

import torch

from mocli.engine.units import Piece, SourceRange
from mocli.io.safetensors_file import TensorEntry, TensorReader, tensor_bytes_view, torch_dtypes


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

    def take(self, nbytes: int, own: int = 0) -> torch.Tensor:
        with self.cond:
            while self.limit and self.out - own > 0 and self.out + nbytes > self.limit:
                self.cond.wait()
            self.out += nbytes
            stack = self.free.get(nbytes)
            if stack:
                self.kept -= nbytes
                return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self.cond:
            for b in bufs:
                n = b.numel()
                self.out -= n
                if self.limit is None or self.kept + n <= self.limit:
                    self.free.setdefault(n, []).append(b)
                    self.kept += n
            self.cond.notify_all()


class UnitContext:
    """What a unit may use: a reader, the compute device, and pooled buffers it borrows.

    Buffers a unit borrows go back to the pool once the engine has written the unit's pieces.
    """

    def __init__(self, reader: TensorReader, device: torch.device, pool: BufferPool) -> None:
        self.reader, self.device, self.pool = reader, device, pool
        self.borrowed: list[torch.Tensor] = []

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor from the pool, valid until the unit's pieces are written (garbage content)."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        buf = self.pool.take(n, own=sum(b.numel() for b in self.borrowed))
        self.borrowed.append(buf)
        return buf.view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The entry's tensor in CPU memory (a pooled buffer)."""
        t = self.buffer(entry.shape, torch_dtypes()[entry.dtype])
        if entry.nbytes:
            self.reader.read_into(entry, t.view(torch.uint8).reshape(-1))
        return t

    def read_rows(self, entry: TensorEntry, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [a, b) of a 2-D (or stacked) tensor into ``out`` (a contiguous CPU view of that size)."""
        row = entry.nbytes // entry.shape[0]
        if b > a:
            self.reader.read_range(entry, a * row, tensor_bytes_view(out))
        return out

    def load(self, entry: TensorEntry) -> torch.Tensor:
        """The entry's tensor on the compute device."""
        t = self.read(entry)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def out(self, like: torch.Tensor) -> torch.Tensor | None:
        """An output buffer for a CPU transform of ``like`` (None on CUDA: torch allocates there)."""
        return self.buffer(tuple(like.shape), like.dtype) if self.device.type == "cpu" else None

    @staticmethod
    def src(entry: TensorEntry) -> SourceRange:
        return SourceRange(entry, 0, entry.nbytes)

    def release(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """Hand over the buffers the unit's pieces still point into (they go back to the pool once
        written); the rest - inputs already consumed, on CUDA everything read and copied to the device
        once the stream is synchronized - go back to the pool now. Half the bytes a quantize unit
        borrowed were its inputs, held until the writer was done."""
        held = {p.data.untyped_storage().data_ptr() for p in pieces
                if isinstance(p.data, torch.Tensor) and p.data.device.type == "cpu"}
        keep = [b for b in self.borrowed if b.untyped_storage().data_ptr() in held]
        done = [b for b in self.borrowed if b.untyped_storage().data_ptr() not in held]
        self.borrowed = []
        if done:
            self.pool.give(done)
        return keep
