"""Safetensors tensor bytes, read without loading the file; the headers are ``mocli.io.header``'s
(re-exported here)."""

from __future__ import annotations

import os
import threading
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from mocli.errors import CorruptFileError, read_error
from mocli.io.header import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorEntry,
    read_header,
    read_headers,
)
from mocli.io.paths import open_regular

__all__ = ["DTYPE_SIZES", "MAX_HEADER_BYTES", "SafetensorsHeader", "TensorEntry", "TensorReader", "np_dtypes",
           "read_header", "read_headers", "tensor_bytes_view", "torch_dtypes"]


if TYPE_CHECKING:  # header-only commands (inspect, validate) never import torch
    import numpy as np
    import torch


@cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype string -> torch dtype (imports torch on first use)."""
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "I16": torch.int16, "F16": torch.float16, "BF16": torch.bfloat16,
        "I32": torch.int32, "F32": torch.float32, "I64": torch.int64, "F64": torch.float64,
    }  # fmt: skip

@cache
def np_dtypes() -> dict[str, np.dtype]:
    """safetensors dtype string -> the numpy dtype its bytes are read as (float8 and bfloat16 as raw words)."""
    import numpy as np

    return {k: np.dtype(v) for k, v in {
        "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
        "F8_E8M0": np.uint8, "I16": np.int16, "U16": np.uint16, "F16": np.float16, "BF16": np.uint16,
        "I32": np.int32, "U32": np.uint32, "F32": np.float32, "I64": np.int64, "U64": np.uint64,
        "F64": np.float64}.items()}  # fmt: skip


def tensor_bytes_view(t: torch.Tensor | np.ndarray) -> memoryview:
    """A byte view of a contiguous CPU tensor's or numpy array's memory (no copy; writable for a tensor)."""
    import ctypes

    if not hasattr(t, "data_ptr"):  # numpy
        if not t.flags.c_contiguous:
            raise ValueError("array is not contiguous")
        return memoryview(t.reshape(-1).view("u1"))
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _truncated(entry: TensorEntry) -> CorruptFileError:
    return CorruptFileError(f"{entry.file}: unexpected end of file reading '{entry.name}'",
                            hint="the file was truncated after it was opened; download it again")


class TensorReader:
    """Reads single tensors by offset. Keeps the most recently used files open (at most ``MAX_OPEN``:
    checkpoints with over a thousand shards exist, past any open-file limit). ``view`` may be called from
    several threads (verify checks bytes beside its GEMMs); reads share descriptors that another
    thread's ``fd`` may close once ``MAX_OPEN`` files are in use, so threads that read keep a reader each.
    ``follow``: whether files may be symbolic links (see io.paths; mocli's own outputs may not)."""

    MAX_OPEN = 8
    ALONE = 1 << 16  # ``byte_maxima``: spans this large are reduced one by one, smaller ones gathered first

    def __init__(self, follow: bool = True) -> None:
        self._files: dict[Path, int] = {}  # in order of last use
        self._maps: dict[Path, object] = {}
        self._lock = threading.Lock()  # the two tables above
        self._unmappable: set[Path] = set()  # files mmap refused (``mapped`` returns None for them)
        self.follow = follow

    def fd(self, path: Path) -> int:
        with self._lock:
            return self._fd(path)

    def _fd(self, path: Path) -> int:
        fd = self._files.pop(path, None)
        if fd is None:
            if len(self._files) >= self.MAX_OPEN:
                oldest = next(iter(self._files))
                os.close(self._files.pop(oldest))
            fd = open_regular(path, self.follow)
        self._files[path] = fd
        return fd

    def read_range(self, entry: TensorEntry, start: int, view: memoryview, short_ok: bool = False) -> bool:
        """Fill ``view`` with the entry's bytes from ``start`` (bytes into the tensor). A file that ends
        first is an error, or (``short_ok``: verify's byte comparisons, where it is a difference) False."""
        fd = self.fd(entry.file)
        done, n = 0, len(view)
        try:
            while done < n:
                got = os.preadv(fd, [view[done:]], entry.start + start + done)
                if got <= 0:
                    if short_ok:
                        return False
                    raise _truncated(entry)
                done += got
        except OSError as e:
            raise read_error(entry.file, e) from None
        return True

    def read_into(self, entry: TensorEntry, out: torch.Tensor) -> torch.Tensor:
        """Read the entry's bytes into ``out`` (a contiguous CPU uint8 tensor of entry.nbytes)."""
        if entry.nbytes:
            self.read_range(entry, 0, memoryview(tensor_bytes_view(out)))
        return out

    def read_bytes(self, entry: TensorEntry) -> bytearray:
        buf = bytearray(entry.nbytes)
        if entry.nbytes:
            self.read_range(entry, 0, memoryview(buf))
        return buf

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """Tensor with the entry's dtype and shape, in CPU memory we own (writable)."""
        import torch

        dtypes = torch_dtypes()
        if entry.dtype not in dtypes:
            raise CorruptFileError(f"{entry.file}: tensor '{entry.name}' has dtype {entry.dtype} "
                                   "that torch cannot represent", hint="mocli cannot process this tensor")
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
        self.read_into(entry, out)
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtypes[entry.dtype])
        return out.view(dtypes[entry.dtype]).reshape(entry.shape)

    def view(self, entry: TensorEntry) -> torch.Tensor:
        """The entry's tensor as a copy-on-write view of the file's page cache (no read, no fresh
        memory): for code that only looks at bytes, like verify. Valid until close()."""
        import torch

        dtypes = torch_dtypes()
        if entry.dtype not in dtypes:
            raise CorruptFileError(f"{entry.file}: tensor '{entry.name}' has dtype {entry.dtype} "
                                   "that torch cannot represent", hint="mocli cannot process this tensor")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtypes[entry.dtype])
        raw = torch.from_numpy(self._mapped_bytes(entry))
        dt = dtypes[entry.dtype]
        return raw.view(dt).reshape(entry.shape) if entry.start % dt.itemsize == 0 else \
            raw.clone().view(dt).reshape(entry.shape)

    def array(self, entry: TensorEntry) -> np.ndarray:
        """``view`` as a numpy array (no torch): float8 and bfloat16, which numpy lacks, as their raw
        integer words (uint8, uint16). Read-only."""
        import numpy as np

        dt = np_dtypes().get(entry.dtype)
        if dt is None:
            raise CorruptFileError(f"{entry.file}: tensor '{entry.name}' has dtype {entry.dtype} "
                                   "that mocli cannot represent", hint="mocli cannot process this tensor")
        if entry.nbytes == 0:
            return np.empty(entry.shape, dtype=dt)
        raw = self._mapped_bytes(entry)
        if entry.start % dt.itemsize:
            raw = raw.copy()
        out = raw.view(dt).reshape(entry.shape)
        out.flags.writeable = False
        return out

    def byte_maxima(self, spans: list[tuple[TensorEntry, int, int]]) -> np.ndarray:
        """The largest byte of each span ``(entry, a, b)``: bytes [a, b) into the entry, 0 for an empty one
        (uint8, in the spans' order), over each file's map: its small spans gathered and reduced in one
        ``np.maximum.reduceat`` (plan-time maxima of ~20k small block-scale tensors, where a call per tensor
        costs more than its look), its large ones one by one. Spans of a file must not overlap."""
        import numpy as np

        out = np.zeros(len(spans), dtype=np.uint8)
        by_file: dict[Path, list[tuple[int, int, int]]] = {}
        for i, (entry, a, b) in enumerate(spans):
            if b > a:
                by_file.setdefault(entry.file, []).append((entry.start + a, entry.start + b, i))
        for file, got in by_file.items():
            got.sort()
            if any(got[k + 1][0] < got[k][1] for k in range(len(got) - 1)):
                raise ValueError(f"{file}: overlapping spans")
            buf = self._mapped_file(file, got[-1][1], spans[got[-1][2]][0])
            small = [g for g in got if g[1] - g[0] < self.ALONE]
            for start, end, i in (g for g in got if g[1] - g[0] >= self.ALONE):
                out[i] = buf[start:end].max()
            if small:  # gathered first: the bytes between spans (an MoE file's weights) are never looked at
                joined = np.concatenate([buf[start:end] for start, end, _ in small])
                firsts = np.cumsum([0] + [end - start for start, end, _ in small[:-1]])
                out[[i for *_, i in small]] = np.maximum.reduceat(joined, firsts)
        return out

    def _mapped_file(self, file: Path, end: int, entry: TensorEntry) -> np.ndarray:
        """The whole file (uint8) over its shared map, checked to hold ``end`` bytes (``entry``: whose)."""
        import mmap

        import numpy as np

        with self._lock:
            mm = self._maps.pop(file, None)
            if mm is None:
                if len(self._maps) >= self.MAX_OPEN:  # a map holds a descriptor of its own until it is unmapped
                    del self._maps[next(iter(self._maps))]  # unmapped once no tensor views it any more
                mm = mmap.mmap(self._fd(file), 0, access=mmap.ACCESS_COPY)
            self._maps[file] = mm
        if end > len(mm):
            raise _truncated(entry)
        return np.frombuffer(mm, dtype=np.uint8)

    def _mapped_bytes(self, entry: TensorEntry) -> np.ndarray:
        """The entry's bytes (uint8) over one shared copy-on-write map per file."""
        return self._mapped_file(entry.file, entry.start + entry.nbytes, entry)[entry.start:entry.start + entry.nbytes]

    def mapped(self, entry: TensorEntry, a: int, b: int) -> torch.Tensor | None:
        """``mapped_array`` as a torch uint8 tensor over the same map."""
        import torch

        arr = self.mapped_array(entry, a, b)
        return None if arr is None else torch.from_numpy(arr)

    def mapped_array(self, entry: TensorEntry, a: int, b: int) -> np.ndarray | None:
        """Bytes [a, b) of the entry (bytes into the tensor) as a uint8 tensor over a copy-on-write
        map of the file's pages made for this call: nothing is read or copied, and a write stays
        private. The map goes when the last tensor viewing it does, so its pages count in the
        process's RSS only as long as the caller keeps them. For the conversions' CPU units: reading
        a weight into a buffer cost as much CPU as the row gather that followed (0.27 against
        0.13 s per 400 MB on the build VM). None where the file cannot be mapped (some network and
        FUSE file systems): the caller reads instead."""
        import mmap

        import numpy as np

        if entry.file in self._unmappable:
            return None
        fd = self.fd(entry.file)
        lo, hi = entry.start + a, entry.start + b
        try:
            size = os.fstat(fd).st_size
        except OSError as e:
            raise read_error(entry.file, e) from None
        if hi > size:
            raise _truncated(entry)
        base = lo - lo % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(fd, hi - base, access=mmap.ACCESS_COPY, offset=base)
        except OSError:
            self._unmappable.add(entry.file)
            return None
        return np.frombuffer(mm, dtype=np.uint8, count=hi - lo, offset=lo - base)

    def drop_pages(self) -> None:
        """Unmap the pages that views have touched: they stay in the page cache, and a view that
        reads them again faults them back in with the same bytes. Verify calls this after every
        module, so its RSS is one module's bytes, not the source's and the output's together
        (12.9 GiB verifying a 6.4 GB output before). Views must not have been written to."""
        import mmap

        from mocli.procenv import madvise

        with self._lock:
            for mm in self._maps.values():
                madvise(mm, mmap.MADV_DONTNEED)  # verify's other threads run meanwhile

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # the mappings close when the last tensor viewing them goes
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
