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


FLOAT_SCALES = ("F32", "BF16", "F16")  # compressed-tensors stores FP8 and KV scales in BF16 too (SEMANTICS §17.2)


def scale_entries(census: Census) -> list[TensorEntry]:
    """Every float scale of a quantized module and every float KV-cache scale."""
    return _module_scales(census) + _kv_scales(census)


def _module_scales(census: Census) -> list[TensorEntry]:
    return [t for m in census.modules.values() if m.scheme is not None
            for s, t in m.tensors.items() if s in SCALE_SUFFIXES and t.dtype in FLOAT_SCALES]


def _kv_scales(census: Census) -> list[TensorEntry]:
    return [t for t in census.kv_scales if t.dtype in FLOAT_SCALES]


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
                words = np.frombuffer(buf, dtype="<f4", count=len(buf) // 4)  # the F32 ones at 4-byte offsets
                for e in es[i:j + 1]:
                    at = e.start - base
                    out[e.name] = words[at >> 2:(at + e.nbytes) >> 2].reshape(e.shape) if e.dtype == "F32" and \
                        not at & 3 else _as_f32(buf, e, at)
                i = j + 1
        finally:
            os.close(fd)
    return out


def _as_f32(buf: bytes, e: TensorEntry, offset: int) -> np.ndarray:
    """An F32, BF16 or F16 tensor's bytes as float32 (exact: both widen)."""
    if e.dtype == "F32":
        return np.frombuffer(buf, dtype="<f4", count=e.nbytes // 4, offset=offset).reshape(e.shape)
    raw = np.frombuffer(buf, dtype="<u2" if e.dtype == "BF16" else "<f2", count=e.nbytes // 2, offset=offset)
    wide = (raw.astype(np.uint32) << 16).view(np.float32) if e.dtype == "BF16" else raw.astype(np.float32)
    return wide.reshape(e.shape)


class Scales(dict):
    """tensor name -> float32 dequant-direction scale; ``divisors`` keeps the file's own values of the ones
    stored as divisors, so 1 / scale is the stored value itself, not a float32 double reciprocal."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.divisors: dict[str, np.ndarray] = {}

    def inverse(self, name: str) -> np.float32:
        """1 / the scale ``name``: its stored divisor where the file holds one, else the float32 reciprocal."""
        d = self.divisors.get(name)
        return np.float32(d.reshape(())) if d is not None else np.reciprocal(np.float32(self[name].reshape(())))


def read_scales(census: Census) -> Scales:
    """tensor name -> float32 array, for every float scale of a quantized module and every KV scale: the
    dequant-direction value, so a spelling's divisors (compressed-tensors' global scales) come back as
    their float32 reciprocal, as vLLM computes it (SEMANTICS §17.1, §17.3)."""
    modules = _module_scales(census)
    out = Scales(read_f32(modules + _kv_scales(census)))
    if census.spelling.divisors:  # (a module's scales only: a KV-cache scale is never a divisor)
        for name in [e.name for e in modules if census.spelling.is_divisor(e.name)]:
            out.divisors[name] = out[name].astype(np.float32)
            out[name] = np.reciprocal(out.divisors[name])
    return out
