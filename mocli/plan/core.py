"""What a plan is made of: output tensors, work units and the pieces of bytes they produce.

Planning decides every output tensor's name, dtype, shape and place before any weight byte moves;
the engine (``mocli.engine``) then runs the units and writes each piece straight to its place.
A piece is either computed bytes (a tensor) or a range of source bytes copied verbatim, which the
engine moves in the kernel (``copy_file_range``) without reading it into Python.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mocli.io.safetensors_file import DTYPE_SIZES, TensorEntry, TensorReader, tensor_bytes_view, torch_dtypes

F32 = torch.float32
Key = tuple[str, str]  # (group: "" or "rank-N", tensor name)


@dataclass
class OutTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    role: str
    sources: list[str]
    transforms: list[str]
    group: str = ""

    @property
    def key(self) -> Key:
        return self.group, self.name

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "role": self.role,
                "sources": self.sources, "transforms": self.transforms}


@dataclass(frozen=True)
class SourceRange:
    """``nbytes`` bytes of a source tensor, from ``start`` bytes into it, copied unchanged."""

    entry: TensorEntry
    start: int
    nbytes: int

    def rows(self, a: int, b: int) -> SourceRange:
        """Rows [a, b) of a 2-D (or 3-D, first dim) tensor: contiguous bytes."""
        row = self.nbytes // self.entry.shape[0]
        return SourceRange(self.entry, self.start + a * row, (b - a) * row)


@dataclass
class Piece:
    """Bytes for part of one output tensor: ``data`` goes ``offset`` bytes into the tensor ``key``."""

    key: Key
    offset: int
    data: torch.Tensor | SourceRange

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, SourceRange):
            return self.data.nbytes
        return self.data.numel() * self.data.element_size()


class BadData(Exception):
    """Source bytes that no layout can carry (NaN codes in FP8 weights or block scales)."""

    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(f"{tensor}: {message}")
        self.tensor, self.message = tensor, message


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


@dataclass
class Unit:
    id: str
    inputs: list[TensorEntry]
    outputs: list[Key]
    run: Callable[[UnitContext], list[Piece]]

    @property
    def input_bytes(self) -> int:
        return sum(e.nbytes for e in self.inputs)


@dataclass
class ConvertedModule:
    """Manifest entry: one kernel-facing module on one rank and the output tensors that feed it."""

    name: str
    kind: str
    scheme: str
    tensors: dict[str, str]
    sources: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    group: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "scheme": self.scheme, "tensors": self.tensors,
                "sources": self.sources, "meta": self.meta}


@dataclass
class Plan:
    """Every output tensor (by (group, name)), the units that produce them, and the manifest modules."""

    tensors: dict[Key, OutTensor] = field(default_factory=dict)
    units: list[Unit] = field(default_factory=list)
    modules: list[ConvertedModule] = field(default_factory=list)
    repairs: dict[str, Any] = field(default_factory=dict)

    def add(self, t: OutTensor) -> str:
        if t.key in self.tensors:
            raise ValueError(f"output tensor {t.name} planned twice in group {t.group!r}")
        self.tensors[t.key] = t
        return t.name

    def groups(self) -> list[str]:
        """Output groups in a stable order: the top level first, then rank-0, rank-1, ..."""
        return sorted({k[0] for k in self.tensors}, key=lambda g: (g != "", len(g), g))


def scalar(v: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(v, dtype=F32).reshape(())


def concat_pieces(key: Key, parts: list[torch.Tensor | SourceRange], start: int = 0) -> list[Piece]:
    """Pieces that lay ``parts`` end to end from byte ``start`` of tensor ``key``."""
    out, off = [], start
    for p in parts:
        piece = Piece(key, off, p)
        out.append(piece)
        off += piece.nbytes
    return out
