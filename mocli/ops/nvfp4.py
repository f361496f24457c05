"""NVFP4 layouts in numpy, on raw bytes: what an NVFP4 conversion does, without torch (SEMANTICS §5-§7).

Every NVFP4 transform only moves bytes (packed FP4 rows, block-scale swizzles, row shuffles) except
rescaling block scales to a shared weight_scale_2, a per-byte function that is a 256-entry table. So
NVFP4 units need neither torch nor a GPU, and a conversion whose units are all of this kind never
imports torch: 2-4.5 s of one core on an H200 host, 2.2-2.7 s on the 2-core build machines, out of a
run of a few seconds. Arrays are uint8, one row per tensor row (``[rows, row bytes]``), so that the
same code moves FP4 pairs, FP8 scales and any other dtype.

The torch transforms (``ops.fp8``, ``ops.layout``) serve the FP8 paths; tests hold the two to the same
bytes (the FP8 rounding here against torch's own cast, every code, thousands of scale pairs).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mocli.ops import swizzled_shape

FP8_MAX = np.float32(448.0)
NAN_CODE = 0x7F  # what NaN becomes (the torch tables agree)


def has_nan_fp8(raw: np.ndarray) -> bool:
    """Any e4m3 NaN byte (0x7F or 0xFF)? As uint8 0xFF is the largest byte, as int8 0x7F is."""
    if raw.size == 0:
        return False
    return bool(raw.max() == 0xFF or raw.view(np.int8).max() == 0x7F)


@lru_cache(maxsize=1)
def _positive_codes() -> np.ndarray:
    """float32 value of codes 0x00..0x7E (ascending with the code): e4m3fn, bias 7, subnormals at e=0."""
    c = np.arange(0x7F, dtype=np.int32)
    e, m = c >> 3, c & 7
    normal = np.ldexp(1.0 + m / 8.0, e - 7)
    sub = np.ldexp(m / 8.0, -6)
    return np.where(e > 0, normal, sub).astype(np.float32)


def decode_fp8(codes: np.ndarray) -> np.ndarray:
    """e4m3fn bytes -> float32 (NaN for 0x7F/0xFF)."""
    pos = np.append(_positive_codes(), np.float32(np.nan))
    mag = pos[codes & 0x7F]
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


def encode_fp8(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn bytes: round to nearest, ties to the even code, saturating at ±448 (torch's
    ``clamp(±448).to(float8_e4m3fn)``); NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.minimum(np.abs(x), FP8_MAX)
    pos = _positive_codes()
    hi = np.searchsorted(pos, mag, side="left").clip(0, len(pos) - 1)  # pos[hi] >= mag
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - pos[lo], pos[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(hi % 2 == 0, hi, lo))).astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(NAN_CODE), code).astype(np.uint8)


@lru_cache(maxsize=4096)
def _rescale_table(s2: float, big: float) -> np.ndarray:
    """out[code] = fp8(float(code) * s2 / S2) in float32, in that order (SEMANTICS §6)."""
    codes = np.arange(256, dtype=np.uint8)
    x = decode_fp8(codes) * np.float32(s2)
    table = encode_fp8(x / np.float32(big))
    table[[0x7F, 0xFF]] = NAN_CODE
    return table


@lru_cache(maxsize=64)
def _pair_table(s2: float, big: float) -> np.ndarray:
    """The table over byte pairs (a uint16 read little-endian): twice the bytes per lookup, 1.8x faster."""
    t = _rescale_table(s2, big).astype(np.uint16)
    p = np.arange(65536)
    return t[p & 0xFF] | (t[p >> 8] << 8)


def rescale_block_scales(raw: np.ndarray, s2: np.floating, big: np.floating) -> np.ndarray:
    """bs' = fp8(float(bs) * s2_i / S2), so bs' * S2 ≈ bs * s2_i (SEMANTICS §6 mocli policy); the
    bytes unchanged (not copied) when s2_i == S2. ``raw``: F8_E4M3 bytes, any shape."""
    if np.float32(s2) == np.float32(big):
        return raw
    key = float(np.float32(s2)), float(np.float32(big))
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.size % 2:
        return _rescale_table(*key)[raw]
    return _pair_table(*key)[flat.view(np.uint16)].view(np.uint8).reshape(raw.shape)


def swizzle_block_scales(raw: np.ndarray) -> np.ndarray:
    """[M, Kb] bytes -> [Mp, Kp] in the 128x4 interleaved order (SEMANTICS §5), zero-padded: element
    (m, k) lands at flat offset (m//128)*(Kp/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4."""
    m, kb = raw.shape
    mp, kp = swizzled_shape(m, kb)
    if (mp, kp) != (m, kb):
        padded = np.zeros((mp, kp), dtype=np.uint8)
        padded[:m, :kb] = raw
        raw = padded
    # four consecutive k stay together (the k % 4 term): move 4-byte words
    words = np.ascontiguousarray(raw).view(np.int32).reshape(mp // 128, 4, 32, kp // 4)
    return np.ascontiguousarray(words.transpose(0, 3, 2, 1)).view(np.uint8).reshape(mp, kp)


def permute_rows(a: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
    """``a[idx]`` along the first dim (None: ``a`` unchanged)."""
    return a if idx is None else np.take(a, idx, axis=0)


def pad_2d(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Zero-pad [r, c] bytes at the end of each dim to [rows, cols]."""
    r, c = a.shape
    if (r, c) == (rows, cols):
        return a
    out = np.zeros((rows, cols), dtype=a.dtype)
    out[:r, :c] = a
    return out
