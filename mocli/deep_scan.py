"""``validate --deep``: every floating-point byte of a checkpoint checked for NaN/Inf codes, at disk speed.

Bit tests on the raw bytes, in reused 4 MiB chunks (no float conversion, no fresh memory):
e4m3 NaN is 0x7F/0xFF (it has no Inf); bf16, f16 and f32 are non-finite when the exponent is all ones.
A U8 tensor is checked where its module's scheme names NaN codes for it (``Scheme.nan_codes``: MXFP8's
E8M0 scale 0xFF); NVFP4's packed e2m1 codes have none, so its U8 weights are skipped.
"""

from __future__ import annotations

import os
from itertools import groupby
from typing import Any

import numpy as np

from mocli.census import Census
from mocli.checkpoint import Checkpoint
from mocli.errors import read_error
from mocli.findings import Findings
from mocli.io.paths import open_regular
from mocli.io.safetensors_file import TensorEntry

CHUNK = 4 << 20
# dtype -> (numpy view, exponent mask): non-finite iff (bits & mask) == mask
_FLOAT = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000),
          "F64": (np.uint64, 0x7FF0000000000000)}


def _bad_chunk(dtype: str, a: np.ndarray, tmp: np.ndarray, codes: tuple[int, ...] = ()) -> bool:
    if codes:  # a 1-byte code the scheme calls NaN
        return bool(np.isin(a, codes).any())
    if dtype == "F8_E4M3":  # as uint8 0xFF is the largest byte; as int8 0x7F is the largest
        return bool(a.max() == 0xFF or a.view(np.int8).max() == 0x7F)
    view, mask = _FLOAT[dtype]
    bits = a.view(view)
    t = tmp[: bits.nbytes].view(view)
    np.bitwise_and(bits, view(mask), out=t)
    return bool(t.max() == mask)


def scheme_codes(census: Census) -> dict[str, tuple[int, ...]]:
    """U8 tensors whose scheme names NaN codes for them: tensor name -> codes."""
    return {t.name: codes for m in census.modules.values() if m.scheme is not None
            for suffix, t in m.tensors.items() if t.dtype == "U8" and (codes := m.scheme.nan_codes_of(suffix))}


def scan(ckpt: Checkpoint, findings: Findings, skip: set[str] = frozenset(), progress: Any = None,
         census: Census | None = None) -> dict[str, Any]:
    """DAT001 for every tensor with a NaN/Inf code; returns {"tensors", "bytes"} scanned."""
    u8 = scheme_codes(census) if census is not None else {}
    entries = [e for e in ckpt.tensors.values() if (e.dtype == "F8_E4M3" or e.dtype in _FLOAT or e.name in u8)
               and e.name not in skip and e.nbytes]
    entries.sort(key=lambda e: (str(e.file), e.start))
    total = sum(e.nbytes for e in entries)
    if progress is not None:
        progress.start(total, len(entries))
    buf = np.empty(CHUNK, dtype=np.uint8)
    tmp = np.empty(CHUNK, dtype=np.uint8)
    for path, group in groupby(entries, key=lambda e: e.file):  # one file open at a time
        fd = open_regular(path)
        try:
            for e in group:
                if _bad_entry(fd, e, buf, tmp, u8.get(e.name, ())):
                    what = ("NaN (" + "/".join(f"0x{c:02X}" for c in u8[e.name]) + ")" if e.name in u8
                            else "NaN (0x7F/0xFF)" if e.dtype == "F8_E4M3" else "NaN or Inf")
                    findings.add("DAT001", e.name, f"{e.dtype} bytes encode {what}",
                                 hint="the export is broken; re-export or re-download the checkpoint")
                if progress is not None:
                    progress.advance(e.nbytes)
        finally:
            os.close(fd)
    return {"tensors": len(entries), "bytes": total}


def _bad_entry(fd: int, e: TensorEntry, buf: np.ndarray, tmp: np.ndarray, codes: tuple[int, ...]) -> bool:
    try:
        width = 1 if e.dtype in ("F8_E4M3", "U8") else _FLOAT[e.dtype][0]().itemsize
        done = 0
        while done < e.nbytes:
            n = min(CHUNK - CHUNK % width, e.nbytes - done)
            got = os.preadv(fd, [memoryview(buf)[:n]], e.start + done)
            if got != n:
                raise OSError(5, "file is shorter than its header says")
            if _bad_chunk(e.dtype, buf[:n], tmp, codes):
                return True
            done += n
    except OSError as err:
        raise read_error(e.file, err) from None
    return False
