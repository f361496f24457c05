"""Lossless MXFP4 -> 128x128 block-FP8 (e4m3fn) re-encoding, SEMANTICS §19.7: the per-matrix core that
``mocli.plan.mxfp4_fp8block_moe`` (convert --mxfp4-experts fp8-block) and validate's TGT004 prediction
(``mocli.validate.reencode``) share. numpy only (convert never loads torch); ``reencode``, ``decode`` and
``dequant`` also take and give torch tensors (the hand-computed tests use them).

A block's one power-of-two scale S = 2^s is chosen by the value-dependent rule: with e_i = k_i + c_i - 127
over the block's nonzero values (|v_i| = mu_i * 2^e_i) and delta_i = 1 when mu_i = 1.5, s must lie in
[max e_i - 8, min(e_i - delta_i) + 9], so a lossless s exists iff max e_i - min(e_i - delta_i) <= 17. It
accepts every block the scale-only rule (c_max - c_min <= 14) accepts, and more. mocli takes the smallest
such s that the engine's clamp of block scales to >= 1e-10 (SEMANTICS §18.2 step 4) leaves alone:
s = max(max e_i - 8, -33); a block whose values need a smaller scale is refused too (``SpreadError.floor``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mocli.numerics.in_numpy import E4M3

BLOCK = 128
S_FLOOR = -33  # 2^-33 ~ 1.16e-10: the smallest power of two vLLM's clamp_(min=1e-10) keeps as it is
# e2m1 code (low 3 bits) -> |v| = mu * 2^k: its magnitude, k, and delta (1 where mu = 1.5); code 0 is zero.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
_K = np.array([0, -1, 0, 0, 1, 1, 2, 2], dtype=np.int32)
_DELTA = np.array([0, 0, 0, 1, 0, 1, 0, 1], dtype=np.int32)
_NONE = 1 << 20  # no nonzero value in a block
_POSITIVE = E4M3[:0x7F].astype(np.float64)  # e4m3fn codes 0..126, increasing


@dataclass
class SpreadError(ValueError):
    """A block whose values cannot share one e4m3 scale losslessly."""
    row: int      # block row index (rows row*128 ..)
    col: int      # block column index
    spread: int   # max e_i - min(e_i - delta_i); lossless needs <= 17
    floor: bool = False  # it fits, but only under a scale below the engine's 1e-10 clamp

    def __str__(self) -> str:
        if self.floor:
            return (f"block (row {self.row}, col {self.col}) holds values so small that their one power-of-two "
                    f"scale falls below 1e-10, which the engine clamps (SEMANTICS §18.2)")
        return (f"block (row {self.row}, col {self.col}) has exponent spread {self.spread} > 17; "
                f"no single power-of-two scale holds its MXFP4 values exactly in e4m3")


def _np(t):
    return t if isinstance(t, np.ndarray) else t.contiguous().numpy()


def unpack(packed: np.ndarray) -> np.ndarray:
    """[R, K/2] uint8 (low nibble first) -> [R, K] e2m1 codes 0..15."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty((p.shape[0], 2 * p.shape[1]), dtype=np.uint8)
    out[:, 0::2], out[:, 1::2] = p & 0xF, p >> 4
    return out


def _decode(nib: np.ndarray, codes: np.ndarray) -> np.ndarray:
    mag = _E2M1[nib & 7]
    val = np.where(nib >= 8, -mag, mag)
    exp = np.repeat(codes.astype(np.int32), 32, axis=1)[:, :nib.shape[1]] - 127
    return np.ldexp(val, exp).astype(np.float32)


def decode(packed, codes):
    """Exact float32 dequantization e2m1 * 2^(c - 127) of [R, K/2] nibbles with [R, K/32] E8M0."""
    out = _decode(unpack(_np(packed)), _np(codes))
    return out if isinstance(packed, np.ndarray) else _torch().from_numpy(out)


def _blocks(x: np.ndarray, fill: int, reduce) -> np.ndarray:
    """[R, K] int32 -> [ceil(R/128), ceil(K/128)] reduced per block (padding ``fill``)."""
    rows, cols = x.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    if (rows, cols) != (nr * BLOCK, nc * BLOCK):
        x = np.pad(x, ((0, nr * BLOCK - rows), (0, nc * BLOCK - cols)), constant_values=fill)
    return reduce(x.reshape(nr, BLOCK, nc, BLOCK), axis=(1, 3))


def block_exponents(nib: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block (max e_i, min(e_i - delta_i)) over its nonzero values; (-_NONE, _NONE) where all are zero."""
    m = (nib & 7).astype(np.intp)
    e = _K[m] + np.repeat(codes.astype(np.int32), 32, axis=1)[:, :nib.shape[1]] - 127
    nz = m != 0
    emax = _blocks(np.where(nz, e, -_NONE), -_NONE, np.max)
    emin = _blocks(np.where(nz, e - _DELTA[m], _NONE), _NONE, np.min)
    return emax, emin


def block_scales(nib: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """float32 [ceil(R/128), ceil(K/128)] scales 2^s (1.0 for an all-zero block); raises SpreadError naming
    the first block (row-major) that has none."""
    emax, emin = block_exponents(nib, codes)
    empty = emax == -_NONE
    s = np.maximum(emax - 8, S_FLOOR)
    bad = ~empty & (s > emin + 9)
    if bool(bad.any()):
        i, j = (int(v) for v in np.argwhere(bad)[0])
        spread = int(emax[i, j] - emin[i, j])
        raise SpreadError(i, j, spread, floor=spread <= 17)
    return np.where(empty, np.float32(1.0), np.ldexp(np.float32(1.0), np.where(empty, 0, s))).astype(np.float32)


def _full(scales: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return np.repeat(np.repeat(scales, BLOCK, axis=0)[:rows], BLOCK, axis=1)[:, :cols]


def _encode_exact(x: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of float32 values each of which an e4m3fn code holds exactly."""
    mag = np.abs(x).astype(np.float64)
    idx = np.minimum(np.searchsorted(_POSITIVE, mag), 0x7E).astype(np.uint8)
    if not np.array_equal(_POSITIVE[idx], mag):  # pragma: no cover - the rule above proves it (§19.7)
        raise AssertionError("e4m3 re-encoding not exact")
    return idx | (np.signbit(x).astype(np.uint8) << 7)


def reencode(packed, codes):
    """[R, K/2] MXFP4 + [R, K/32] E8M0 -> (e4m3fn codes [R, K], float32 scales [ceil(R/128), ceil(K/128)]).

    numpy in, numpy out (uint8 codes); torch in, torch out (float8_e4m3fn). Raises SpreadError naming the
    first block that does not fit; asserts the exactness of every value."""
    nib, c = unpack(_np(packed)), _np(codes)
    scales = block_scales(nib, c)
    ref = _decode(nib, c)
    q = _encode_exact(ref / _full(scales, *ref.shape))
    if isinstance(packed, np.ndarray):
        return q, scales
    torch = _torch()
    return torch.from_numpy(q).view(torch.float8_e4m3fn), torch.from_numpy(scales)


def dequant(q, scales):
    """e4m3 [R, K] (uint8 codes, or a torch float8 tensor) * block scales -> float32 (the verify side)."""
    if isinstance(q, np.ndarray):
        return E4M3[q] * _full(np.asarray(scales, dtype=np.float32), *q.shape)
    torch = _torch()
    out = E4M3[q.view(torch.uint8).contiguous().numpy()] * _full(_np(scales).astype(np.float32), *q.shape)
    return torch.from_numpy(out)


def _torch():
    import torch

    return torch
