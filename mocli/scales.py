"""The small float32 scale tensors of a checkpoint (0-dim, per-channel, per-block), read once.

No torch here (validate and inspect stay fast to start): neighbouring scales are read with one
``pread`` per file region and viewed as numpy float32 arrays.
"""

from __future__ import annotations

import os

import numpy as np

from mocli.census import Census
from mocli.errors import read_error
from mocli.io.paths import open_regular
from mocli.io.safetensors_file import TensorEntry
from mocli.tables import SCALE_SUFFIXES

GAP = 1 << 20  # read across gaps up to this size instead of issuing another call


def scale_entries(census: Census) -> list[TensorEntry]:
    """Every F32 scale of a quantized module and every F32 KV-cache scale."""
    entries = [t for m in census.modules.values() if m.scheme is not None
               for s, t in m.tensors.items() if s in SCALE_SUFFIXES and t.dtype == "F32"]
    return entries + [t for t in census.kv_scales if t.dtype == "F32"]


def read_f32(entries: list[TensorEntry]) -> dict[str, np.ndarray]:
    """name -> float32 array of the entry's shape, reading each file's regions in few calls."""
    out: dict[str, np.ndarray] = {}
    by_file: dict = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for path, es in by_file.items():
        es.sort(key=lambda e: e.start)
        fd = open_regular(path)
        try:
            i = 0
            while i < len(es):
                j, end = i, es[i].start + es[i].nbytes
                while j + 1 < len(es) and es[j + 1].start - end <= GAP:
                    j += 1
                    end = max(end, es[j].start + es[j].nbytes)
                base = es[i].start
                try:
                    buf = os.pread(fd, end - base, base)
                except OSError as err:
                    raise read_error(path, err) from None
                if len(buf) != end - base:
                    raise read_error(path, OSError(5, "file is shorter than its header says"))
                for e in es[i:j + 1]:
                    a = e.start - base
                    out[e.name] = np.frombuffer(buf, dtype="<f4", count=e.nbytes // 4, offset=a).reshape(e.shape)
                i = j + 1
        finally:
            os.close(fd)
    return out


def read_scales(census: Census) -> dict[str, np.ndarray]:
    """tensor name -> float32 array, for every F32 scale of a quantized module and every KV scale."""
    return read_f32(scale_entries(census))
