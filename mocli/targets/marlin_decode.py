"""The marlin layout's inverses: what verify and the serving emulation decode a Marlin module with.

Written from SEMANTICS §13.5's description of vLLM's python reference (16x16 tiles, the 1024-entry
permutation of ``get_weight_perm(4)``, the scale permutations and the E5M3 form) rather than from the
forward's factoring (``mocli.ops.marlin``), so a wrong forward transform cannot cancel itself out.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mocli.numerics import FP8_MAX
from mocli.targets.decode import LayoutError


@lru_cache(maxsize=1)
def _entry_of_slot() -> np.ndarray:
    """For each of the 8 nibbles of a Marlin word, which entry of its (i, j) group of ``get_weight_perm``
    it holds: the perm list's groups of 8 (block 0's four rows, then block 1's) were read at
    [0, 2, 4, 6, 1, 3, 5, 7]."""
    return np.array([0, 2, 4, 6, 1, 3, 5, 7])


def decode_weight(stored: np.ndarray, n: int, k: int, what: str) -> np.ndarray:
    """Marlin words (bytes [Kp/16, 8 Np], or int32 [Kp/16, 2 Np]) -> the packed NVFP4 weight uint8
    [n, k/2] (low nibble first); the padding rows and columns must be zero codes."""
    raw = np.ascontiguousarray(stored).view(np.uint8)
    kt, nbytes = raw.shape
    np_, kp = nbytes // 8, 16 * kt
    # nibble s of each word: words [kt, c, i, j] of 8 nibbles (i: the perm list's group, j: its 256-block)
    nib = np.empty((*raw.shape, 2), dtype=np.uint8)
    np.bitwise_and(raw, 0x0F, out=nib[..., 0])
    np.right_shift(raw, 4, out=nib[..., 1])
    slots = nib.reshape(kt, np_ // 64, 32, 4, 8)
    entries = np.empty_like(slots)
    entries[..., _entry_of_slot()] = slots  # entry e = 4 * block + r sits in nibble slot s
    # i = 4 col + q; entry (block, r): row = (2q, 2q + 1, 2q + 8, 2q + 9)[r] = 8 (r // 2) + 2q + r % 2, column =
    # col + 8 block; a 16x16 tile's (row, column) is code (16 kt + row, 16 (4c + j) + column)
    e = entries.reshape(kt, np_ // 64, 8, 4, 4, 2, 2, 2)  # [kt, c, col, q, j, block, r//2, r%2]
    codes = e.transpose(0, 6, 3, 7, 1, 4, 5, 2).reshape(kp, np_)  # [kt, r//2, q, r%2 | c, j, block, col]
    w = codes.T  # [Np, Kp] codes
    if bool(w[n:].any()) or bool(w[:n, k:].any()):
        raise LayoutError(f"{what}: Marlin padding is not zero")
    w = np.ascontiguousarray(w[:n, :k])
    return (w[:, 0::2] | (w[:, 1::2] << 4)).astype(np.uint8)


@lru_cache(maxsize=1)
def _scale_slots() -> np.ndarray:
    """Where each of a run of 64 scales goes (the inverse of ``marlin_permute_scales``' 8x8 transpose
    and the [0, 2, 1, 3] swap in each 4): position of source element i + 8j among the stored 64."""
    stored_from = np.empty(64, dtype=np.int64)  # stored position p reads transposed position q = 4(p//4) + sw
    for p in range(64):
        q = 4 * (p // 4) + (0, 2, 1, 3)[p % 4]
        i, j = divmod(q, 8)
        stored_from[p] = i + 8 * j
    return np.argsort(stored_from)


@lru_cache(maxsize=64)
def _code_of_byte(sf: float) -> np.ndarray:
    """uint8 [256]: a Marlin scale byte -> the e4m3 code it was made from. The byte is bits 7..14 of the
    fp16 ``scale * sf * 2^7`` (its sign 0, the low 7 mantissa bits 0 for an e4m3 input); byte 0 is a
    flushed block (code 0)."""
    from mocli.numerics.in_numpy import e4m3_encode

    half = (np.arange(256, dtype=np.uint16) << 7).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):  # bytes 0xF8.. are fp16 Inf/NaN: never written (sf keeps scales <= 448)
        return e4m3_encode(np.minimum(half / np.float32(128) / np.float32(sf), FP8_MAX))


def decode_scales(stored: np.ndarray, n: int, kb: int, sf: float, what: str) -> np.ndarray:
    """Marlin block-scale bytes [Kp/16, Np] -> e4m3 codes uint8 [n, kb] (flushed blocks as code 0);
    padding must be zero."""
    raw = np.ascontiguousarray(stored).view(np.uint8)
    kt, np_ = raw.shape
    back = raw.reshape(-1, 64)[:, _scale_slots()].reshape(kt, np_)
    if bool(back[kb:].any()) or bool(back[:kb, n:].any()):
        raise LayoutError(f"{what}: Marlin scale padding is not zero")
    return np.ascontiguousarray(_code_of_byte(sf)[back[:kb, :n]].T)


def flushed(codes: np.ndarray, sf: float) -> np.ndarray:
    """The e4m3 block-scale codes a Marlin layout holds for ``codes``: those under 2^-6 once scaled by
    ``sf`` become 0 (SEMANTICS §13.5: the kernel reads them as zero blocks)."""
    from mocli.numerics.in_numpy import E4M3

    keep = E4M3[codes] * np.float32(sf) >= np.float32(2.0**-6)
    return np.where(keep, codes, np.uint8(0))


def decode_bias(stored: np.ndarray, n: int, what: str) -> np.ndarray:
    """A Marlin bias [Np] (any element size, as [Np, bytes]) back to [n]: the runs of 32 un-permuted."""
    perm = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    back = np.empty_like(stored.reshape(-1, 32, *stored.shape[1:]))
    back[:, perm] = stored.reshape(-1, 32, *stored.shape[1:])
    back = back.reshape(stored.shape)
    if bool(back[n:].any()):
        raise LayoutError(f"{what}: Marlin bias padding is not zero")
    return back[:n]


# vLLM's exponent bias of the activation dtype minus 7: the factor the global scale was multiplied by
# (``nvfp4_marlin_process_global_scale``); read back from the manifest's ``act_dtype``
GLOBAL_SHIFT = {"bfloat16": 119, "float16": 7}


def global_of(stored: float | np.ndarray, sf: float, act_dtype: str) -> np.ndarray:
    """A stored Marlin global scale (``S2 * 2^(bias - 7) / sf``, float32) -> the source's S2: exact, both
    factors being powers of two."""
    if act_dtype not in GLOBAL_SHIFT:
        raise LayoutError(f"act_dtype {act_dtype!r} is not bfloat16 or float16")
    return (np.asarray(stored, dtype=np.float32) * np.float32(sf) / np.float32(2.0 ** GLOBAL_SHIFT[act_dtype])).astype(np.float32)


def halves(rows: np.ndarray, i: int, ip: int, what: str) -> np.ndarray:
    """An expert's w13 rows [2 Ip, ...] as stored for Marlin ([w1; w3], each zero-padded to Ip) -> the
    source's [w1; w3] rows [2 I, ...]; the padding must be zero."""
    if bool(rows[i:ip].any()) or bool(rows[ip + i:].any()):
        raise LayoutError(f"{what}: Marlin w13 padding rows are not zero")
    return np.concatenate([rows[:i], rows[ip:ip + i]])
