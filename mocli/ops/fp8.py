"""FP8 (e4m3) bytes in numpy: codes to values and back, NaN detection, and the per-byte tables that
requantize FP8 weights (SEMANTICS §3, §4) and rescale NVFP4 block scales (§6).

Every FP8 and NVFP4 transform of a conversion only moves bytes, except requantizing a shard or a w1/w3
half to a shared scale and rescaling block scales to a shared weight_scale_2: per-byte functions, so
256-entry tables built by running the float32 formula on every code (looked up two bytes at a time).
So no conversion unit needs torch or a GPU, and a conversion never imports torch: 2-4.5 s of one core
on an H200 host, 2.2-2.7 s on the 2-core build machines, out of a run of a few seconds. Tests hold the
rounding to torch's own float8 cast (every code, every midpoint, a million values) and the tables to
the formulas run in torch (thousands of scale pairs).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mocli.numerics.lookup import byte_lookup

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
def _table(kind: str, s: float, big: float) -> np.ndarray:
    """out[code] for every code, in float32, in SEMANTICS' order: "requant" fp8(float(q) * s * (1/S)),
    1/S rounded once (§3); "requant_f16" the same with q * s taken in float16, scale included, as vLLM's
    ``per_tensor_dequantize`` computes it on a GPU (§17.2); "rescale" fp8(float(bs) * s2 / S2) (§6). NaN in, NaN (0x7F) out."""
    x = decode_fp8(np.arange(256, dtype=np.uint8)) * np.float32(s)
    if kind == "requant_f16":  # float16(q) * float16(s): the scale is rounded too where both are on a GPU
        with np.errstate(over="ignore"):  # beyond float16's range is inf, as in torch; encode_fp8 saturates it
            q16 = decode_fp8(np.arange(256, dtype=np.uint8)).astype(np.float16).astype(np.float32)
            x = (q16 * np.float32(np.float16(s))).astype(np.float16).astype(np.float32)
    x = x / np.float32(big) if kind == "rescale" else x * np.reciprocal(np.float32(big))
    table = encode_fp8(x)
    table[[0x7F, 0xFF]] = NAN_CODE
    return table


def _apply(kind: str, raw: np.ndarray, s: np.floating, big: np.floating) -> np.ndarray:
    """``raw`` (F8_E4M3 bytes, any shape) through the table; the bytes unchanged (not copied) when
    s == big (mocli policy: the max-scale shard is kept byte for byte), except through float16."""
    if np.float32(s) == np.float32(big) and kind != "requant_f16":
        return raw
    return byte_lookup(raw, _table(kind, float(np.float32(s)), float(np.float32(big))))


def requantize_fp8(raw: np.ndarray, s: np.floating, big: np.floating, f16: bool = False) -> np.ndarray:
    """q' = fp8(clamp(float(q) * s * (1/S), ±448)) (SEMANTICS §3): an FP8 shard or w1/w3 half moved to
    the shared (max) scale S; unchanged when already at S. ``f16``: q * s rounded to float16 first and
    applied at S too, as vLLM's compressed-tensors path does (§17.2: ``Spelling.fp8_requant_f16``)."""
    return _apply("requant_f16" if f16 else "requant", raw, s, big)


def rescale_codes(codes: np.ndarray, s2: np.ndarray, big: np.ndarray) -> np.ndarray:
    """``rescale_block_scales`` element by element, each code with its own (s2_i, S2): the same bytes as
    its table (float32 ``float(bs) * s2_i / S2``, encoded; NaN codes stay NaN; unchanged where s2_i == S2).
    Planning rescales one top code per expert this way, in one call instead of a table each."""
    codes = np.asarray(codes, dtype=np.uint8)
    s2, big = np.asarray(s2, dtype=np.float32), np.asarray(big, dtype=np.float32)
    out = encode_fp8(decode_fp8(codes) * s2 / big)
    out[(codes & 0x7F) == 0x7F] = NAN_CODE
    return np.where(s2 == big, codes, out).astype(np.uint8)


def rescale_table(s2: np.floating, big: np.floating) -> np.ndarray | None:
    """uint8 [256]: ``rescale_block_scales``' code -> code map, for composing with a later table; None
    where it is the identity (s2 == S2)."""
    if np.float32(s2) == np.float32(big):
        return None
    return _table("rescale", float(np.float32(s2)), float(np.float32(big)))


def rescale_block_scales(raw: np.ndarray, s2: np.floating, big: np.floating) -> np.ndarray:
    """bs' = fp8(float(bs) * s2_i / S2), so bs' * S2 ≈ bs * s2_i (SEMANTICS §6 mocli policy); the
    bytes unchanged (not copied) when s2_i == S2."""
    return _apply("rescale", raw, s2, big)


