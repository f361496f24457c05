"""Pre-planned safetensors shards: headers written first, tensor bytes written in place later.

Every tensor's shard and byte offset is fixed before any data moves, so work units can write
their results straight to their place (``pwrite``), in any order, and a resumed run rewrites
exactly the same bytes.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # the Hugging Face default, "5GB"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class ShardFile:
    name: str
    tensors: list[TensorSpec] = field(default_factory=list)
    header: bytes = b""
    size: int = 0


@dataclass
class ShardLayout:
    files: list[ShardFile]
    where: dict[str, tuple[int, int, int]]  # name -> (file index, absolute offset, nbytes)

    def weight_map(self) -> dict[str, str]:
        return {t.name: f.name for f in self.files for t in f.tensors}

    def to_dict(self) -> dict:
        return {f.name: [[t.name, t.dtype, list(t.shape)] for t in f.tensors] for f in self.files}


def layout_shards(specs: list[TensorSpec], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                  metadata: dict[str, str] | None = None) -> ShardLayout:
    """Greedy, order-preserving split (as huggingface_hub's splitter does), always named
    model-0000N-of-0000M even for one shard so the layout is uniform; then offsets."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if groups[-1] and size + s.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    files: list[ShardFile] = []
    where: dict[str, tuple[int, int, int]] = {}
    meta = {"format": "pt", **(metadata or {})}
    for idx, group in enumerate(groups):
        f = ShardFile(SHARD_PATTERN.format(index=idx + 1, count=len(groups)), group)
        header: dict = {"__metadata__": meta}
        off = 0
        for s in group:
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
            off += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f.header = struct.pack("<Q", len(raw)) + raw
        f.size = len(f.header) + off
        data_start = len(f.header)
        for s in group:
            begin = header[s.name]["data_offsets"][0]
            where[s.name] = (idx, data_start + begin, s.nbytes)
        files.append(f)
    return ShardLayout(files, where)


def tensor_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A zero-copy byte view of a CPU tensor (and the tensor that keeps the memory alive)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b""), t
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"), t


def shards_intact(directory: Path, layout: ShardLayout) -> bool:
    """Every planned shard exists with its planned size and header (a resume may trust its journal)."""
    for f in layout.files:
        path = directory / f.name
        try:
            if path.stat().st_size != f.size:
                return False
            with open(path, "rb") as fh:
                if fh.read(len(f.header)) != f.header:
                    return False
        except OSError:
            return False
    return True


class ShardWriter:
    """Opens every planned shard for positional writes: re-opened as is when resuming, else created."""

    def __init__(self, directory: Path, layout: ShardLayout, resume: bool) -> None:
        self.layout = layout
        self.fds: list[int] = []
        for f in layout.files:
            path = directory / f.name
            if resume:  # the caller checked shards_intact()
                fd = os.open(path, os.O_RDWR)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                os.pwrite(fd, f.header, 0)
                os.ftruncate(fd, f.size)  # sparse until written; unwritten regions read as zeros
            self.fds.append(fd)

    def write(self, name: str, offset: int, data: torch.Tensor) -> int:
        idx, start, nbytes = self.layout.where[name]
        view, _keep = tensor_bytes(data)
        if offset + len(view) > nbytes:
            raise RuntimeError(f"write of {len(view)} bytes at {offset} overflows {name} ({nbytes} bytes)")
        fd, pos, done = self.fds[idx], start + offset, 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], pos + done)
        return len(view)

    def sync(self) -> None:
        for fd in self.fds:
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
