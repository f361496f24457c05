"""``validate --deep``: every floating-point byte of a checkpoint checked for NaN/Inf codes, at disk speed.

Bit tests on the raw bytes, in reused 4 MiB chunks (no float conversion, no fresh memory):
e4m3 NaN is 0x7F/0xFF (it has no Inf); bf16, f16 and f32 are non-finite when the exponent is all ones.
NVFP4's packed e2m1 codes have neither, so U8 weights are skipped.
"""

from __future__ import annotations

import os
from itertools import groupby
from typing import Any

import numpy as np

from mocli.checkpoint import Checkpoint
from mocli.errors import read_error
from mocli.findings import Findings
from mocli.io.paths import open_regular
from mocli.io.safetensors_file import TensorEntry

CHUNK = 4 << 20
# dtype -> (numpy view, exponent mask): non-finite iff (bits & mask) == mask
_FLOAT = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000),
          "F64": (np.uint64, 0x7FF0000000000000)}


def _bad_chunk(dtype: str, a: np.ndarray, tmp: np.ndarray) -> bool:
    if dtype == "F8_E4M3":  # as uint8 0xFF is the largest byte; as int8 0x7F is the largest
        return bool(a.max() == 0xFF or a.view(np.int8).max() == 0x7F)
    view, mask = _FLOAT[dtype]
    bits = a.view(view)
    t = tmp[: bits.nbytes].view(view)
    np.bitwise_and(bits, view(mask), out=t)
    return bool(t.max() == mask)


def scan(ckpt: Checkpoint, findings: Findings, skip: set[str] = frozenset(), progress: Any = None) -> dict[str, Any]:
    """DAT001 for every tensor with a NaN/Inf code; returns {"tensors", "bytes"} scanned."""
    entries = [e for e in ckpt.tensors.values() if (e.dtype == "F8_E4M3" or e.dtype in _FLOAT)
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
                if _bad_entry(fd, e, buf, tmp):
                    what = "NaN (0x7F/0xFF)" if e.dtype == "F8_E4M3" else "NaN or Inf"
                    findings.add("DAT001", e.name, f"{e.dtype} bytes encode {what}",
                                 hint="the export is broken; re-export or re-download the checkpoint")
                if progress is not None:
                    progress.advance(e.nbytes)
        finally:
            os.close(fd)
    return {"tensors": len(entries), "bytes": total}


def _bad_entry(fd: int, e: TensorEntry, buf: np.ndarray, tmp: np.ndarray) -> bool:
    try:
        width = 1 if e.dtype == "F8_E4M3" else _FLOAT[e.dtype][0]().itemsize
        done = 0
        while done < e.nbytes:
            n = min(CHUNK - CHUNK % width, e.nbytes - done)
            got = os.preadv(fd, [memoryview(buf)[:n]], e.start + done)
            if got != n:
                raise OSError(5, "file is shorter than its header says")
            if _bad_chunk(e.dtype, buf[:n], tmp):
                return True
            done += n
    except OSError as err:
        raise read_error(e.file, err) from None
    return False
