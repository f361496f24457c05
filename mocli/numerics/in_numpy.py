"""The number formats in numpy, without torch: e4m3 and e2m1 codes, the NVFP4 activation model and the
source's dequantization (verify's NVFP4 checks).

Written apart from the converter's encoder (``mocli.ops.nvfp4`` rounds by bit arithmetic): e4m3 codes
are decoded from SEMANTICS §1's formula, and a value is encoded by searching the sorted table of
every code's value, nearest first and ties to the even code. ``tests/test_verify_numeric.py`` checks
both against torch's float8 cast on every code and on millions of values.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mocli.numerics import E2M1_MAX, E2M1_VALUES, FP8_MAX

E2M1 = np.array(E2M1_VALUES, dtype=np.float32)
# Midpoints between neighbouring e2m1 magnitudes: how many lie below |x| is its nearest code.
_MIDS = (E2M1[1:] + E2M1[:-1]) / 2


def _e4m3_values() -> np.ndarray:
    """float32 [256]: the value of every e4m3fn code (bit 7 sign, 4 exponent bits of bias 7, 3
    mantissa bits; exponent 0 subnormal; S.1111.111 NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 0xF, codes & 7
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    vals = (sign * mag).astype(np.float32)
    nan = (codes & 0x7F) == 0x7F
    vals[nan] = np.copysign(np.float32(np.nan), sign[nan])  # the sign kept: -NaN scales to -NaN
    return vals


E4M3 = _e4m3_values()
_POSITIVE = E4M3[:0x7F].astype(np.float64)  # codes 0..126, increasing


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """uint8 codes of float values with |x| <= 448 (callers clamp first, as the kernels do) or NaN:
    the nearest code, ties to the even one (round to nearest even), the sign kept (-0.0 is 0x80)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    hi = np.clip(np.searchsorted(_POSITIVE, a), 1, 0x7E)
    lo = hi - 1
    d_lo, d_hi = a - _POSITIVE[lo], _POSITIVE[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(up, hi, lo).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7F), code)
    return code | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to e4m3 (as codes, then decoded)."""
    return E4M3[e4m3_encode(x)]


def e2m1_round(x: np.ndarray) -> np.ndarray:
    """Nearest e2m1 value (float32), saturating at ±6; a value on a midpoint goes to the lower one.

    The code is the number of midpoints below |x|, counted with seven comparisons (a search over
    seven values ran at 19 ns a value, 5.7x slower)."""
    v = np.minimum(np.abs(x), np.float32(E2M1_MAX))
    idx = np.zeros(v.shape, dtype=np.uint8)
    for mid in _MIDS:
        idx += v > mid
    return (np.sign(x) * E2M1[idx]).astype(np.float32)


def nvfp4_quant(x: np.ndarray, global_scale) -> np.ndarray:
    """NVFP4 activation quantization as FlashInfer's fp4_quantize(x, global_scale) does it.

    Per 16-element block: sf = fp8(amax / 6 * gs); values e2m1(x * gs / sf). Returns the exact
    product e2m1 * sf (float32, exactly representable in bf16); the true value is that / gs.
    (The same model as ``mocli.numerics.in_torch.nvfp4_quant``, which the serving emulation runs in torch;
    a test holds the two equal.)"""
    t, k = x.shape
    gs = np.float32(np.asarray(global_scale, dtype=np.float32).reshape(()))
    b = x.astype(np.float32, copy=False).reshape(t, k // 16, 16)
    sf = e4m3_round(np.minimum(np.abs(b).max(axis=-1, keepdims=True) / np.float32(E2M1_MAX) * gs,
                               np.float32(FP8_MAX)))
    safe = np.where(sf > 0, sf, np.float32(1))
    q = np.where(sf > 0, e2m1_round(b * gs / safe), np.float32(0))
    return (q * sf).reshape(t, k)


def _pairs() -> np.ndarray:
    """float32 [256, 2]: the two e2m1 values of a byte (low nibble first, bit 3 the sign)."""
    codes = np.arange(256)
    lo, hi = codes & 0xF, codes >> 4
    val = lambda c: np.where(c >= 8, -1.0, 1.0) * E2M1[c & 7]  # noqa: E731
    return np.stack([val(lo), val(hi)], axis=1).astype(np.float32)


# the pair of a byte as one 8-byte word: a one-dimensional lookup per byte is 5x faster in numpy than
# indexing the [256, 2] table (20 against 100 ms for 8 MB); np.take, not ``table[idx]``: numpy's fancy
# indexing with small unsigned indices ran 2.6-5x slower than take (77 against 16 ms for 6 MB, 2026-11-28)
_PAIRS = _pairs().view(np.int64).reshape(256)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> float32 [..., K]: one table lookup per byte."""
    return np.take(_PAIRS, packed).view(np.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@lru_cache(maxsize=64)
def _scaled_pairs(scale_2: float | None) -> np.ndarray:
    """int64 [65536]: for index ``scale code << 8 | byte``, the byte's two e2m1 values times the
    block scale (times ``scale_2``, first multiplied into the block scale), as two float32 words."""
    bs = E4M3 if scale_2 is None else E4M3 * np.float32(scale_2)
    pairs = _PAIRS.view(np.float32).reshape(1, 256, 2) * bs.reshape(256, 1, 1)
    return np.ascontiguousarray(pairs).view(np.int64).reshape(65536)


def _lookup(table: np.ndarray, packed: np.ndarray, block_scales: np.ndarray) -> np.ndarray:
    """float32 [N, K] of packed e2m1 [N, K/2] and block scale codes [N, K/16] through ``table``
    (``_scaled_pairs``): one lookup per byte for its (scale, byte) pair, instead of decoding and then
    scaling (about half the passes over the float32 output)."""
    n, half = packed.shape
    idx = (block_scales.astype(np.uint16)[:, :, None] << 8) | packed.reshape(n, half // 8, 8)  # a block's 8 bytes
    return np.take(table, idx).view(np.float32).reshape(n, half * 2)


# weight rows dequantized at a time by ``scaled_matmul``: 2 MB of float32 at K = 4096, which the GEMM then
# reads from the core's cache
MATMUL_ROWS = 128


def scaled_matmul(x: np.ndarray, packed: np.ndarray, block_scales: np.ndarray,
                  scale_2: float | None = None) -> np.ndarray:
    """``x @ W.T`` (float32 [T, N]) for the NVFP4 weight W of packed e2m1 [N, K/2] and block scale codes
    [N, K/16] (times ``scale_2`` where given), W dequantized ``MATMUL_ROWS`` rows at a time and each
    block multiplied while it is in cache: the exact e2m1 x block scale products, then a GEMM, without
    a layer-sized float32 copy of the weight (0.82 of the time on the build machine)."""
    table = _scaled_pairs(None if scale_2 is None else float(scale_2))
    n = packed.shape[0]
    out = np.empty((n, x.shape[0]), dtype=np.float32)
    xt = x.T
    for a in range(0, n, MATMUL_ROWS):
        b = min(n, a + MATMUL_ROWS)
        np.matmul(_lookup(table, packed[a:b], block_scales[a:b]), xt, out=out[a:b])
    return out.T


def dequant_nvfp4(packed: np.ndarray, block_scales: np.ndarray, scale_2: float) -> np.ndarray:
    """A source NVFP4 weight in float32: e2m1 x (block scale x weight_scale_2)."""
    return _lookup(_scaled_pairs(float(scale_2)), packed, block_scales)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), as x / 2 * (1 + tanh(x / 2)): no overflow for large |x| (within a few ulp of
    torch's silu, which the kernel emulation need not match bit for bit: its inputs are exact, its
    output is quantized)."""
    half = x * np.float32(0.5)
    return half * (np.float32(1) + np.tanh(half))


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest BF16 (ties to even), as float32: an activation as a BF16
    model hands it to a weight-only kernel. NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, r).astype(np.float32)


def mxfp8_quant(x: np.ndarray) -> np.ndarray:
    """``in_torch.mxfp8_quant`` in numpy: per 32 values an E8M0 scale 2^(ceil(log2(amax / 448))), biased
    exponent clamped to 0..254, each value e4m3-rounded after dividing by it; returned dequantized."""
    blocks = np.asarray(x, dtype=np.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), np.finfo(np.float32).tiny)
    with np.errstate(divide="ignore"):
        biased = np.clip(np.ceil(np.log2(amax / np.float32(FP8_MAX))) + 127, 0, 254)
    scale = np.exp2(biased - 127).astype(np.float32)[..., None]
    return (e4m3_round(blocks / scale) * scale).reshape(x.shape).astype(np.float32)


def fp8_per_group_quant(x: np.ndarray, group: int = 128) -> np.ndarray:
    """``in_torch.fp8_per_group_dequant`` in numpy: dynamic per-token-group (1 x ``group``) FP8, a float32
    scale amax / 448 per group (at least 1e-12), returned dequantized."""
    t, k = x.shape
    g = np.asarray(x, dtype=np.float32).reshape(t, k // group, group)
    s = np.maximum(np.abs(g).max(axis=-1, keepdims=True) / np.float32(FP8_MAX), np.float32(1e-12))
    return (e4m3_round(np.clip(g / s, -FP8_MAX, FP8_MAX)) * s).reshape(t, k).astype(np.float32)
