"""Marlin's NVFP4 weight repack in C (csrc/marlin_repack.c, built by ``pip install`` where a C compiler is
found): one pass where ``mocli.ops.marlin``'s numpy takes a dozen (on one core of a 2-core AMD EPYC VM,
alternated in one process: 0.28-0.32 s/GB against 1.70-1.76). verify's inverse has its own
(``mocli.targets.marlin_decode``).

``OK`` says whether it loaded; without it (no compiler at install, or ``MOCLI_NATIVE=0``: tests compare
both paths) the numpy passes run, byte for byte the same. The C code takes raw addresses: every shape,
stride and bound is checked here first, and the GIL is released while it runs (threads share the work).
"""

from __future__ import annotations

import numpy as np

from mocli.procenv import native

_c = native("mocli.ops._marlin_repack")
OK = _c is not None


def takes(w: np.ndarray, kp: int, out: np.ndarray, groups: int) -> bool:
    """Whether the C repack is built and takes these as they are (``problem`` finds nothing); else the
    numpy passes run."""
    return OK and problem(w, kp, out, 0, groups) is None


def problem(w: np.ndarray, kp: int, out: np.ndarray, c0: int, c1: int) -> str | None:
    """What the C code would misread in these arguments, or None: both arrays uint8 [rows, bytes] with
    contiguous rows that do not overlap, K/2 a multiple of 8 within Kp/2, the words [Kp/16, >= 512 c1] and
    writable, 0 <= c0 <= c1."""
    for a in (w, out):
        if a.dtype != np.uint8 or a.ndim != 2 or a.strides[1] != 1 or a.strides[0] < max(a.shape[1], 1):
            return f"uint8 [rows, bytes] with contiguous rows expected, got {a.dtype} {a.shape} strides {a.strides}"
    kb = w.shape[1]
    if kp % 16 or kb % 8 or kb > kp // 2 or out.shape[0] != kp // 16 or out.shape[1] < 512 * c1 or not 0 <= c0 <= c1:
        return f"weight {w.shape}, Kp {kp}, words {out.shape}, groups [{c0}, {c1})"
    if not out.flags.writeable:
        return "the words are read-only"
    return None


def repack(w: np.ndarray, kp: int, out: np.ndarray, c0: int, c1: int) -> None:
    """Groups [c0, c1) of 64 rows of the packed weight ``w`` (uint8 [N, K/2], rows past N and bytes past
    K/2 read as zero) into their words of ``out`` (uint8 [Kp/16, 8 Np], or any [Kp/16, >= 512 c1] whose
    rows are contiguous: the columns [512 c0, 512 c1) are written). ValueError where ``problem`` finds one."""
    why = problem(w, kp, out, c0, c1)
    if why is not None:
        raise ValueError(f"Marlin repack: {why}")
    _c.repack(w.ctypes.data, w.strides[0], w.shape[0], w.shape[1], kp, out.ctypes.data, out.strides[0], c0, c1)
