"""Lossless MXFP4 -> 128x128 block-FP8 (e4m3fn) re-encoding, SEMANTICS §19.7.

Core math only (the planner wiring into `fp8_block_moe` is not done yet). A block's one
power-of-two scale S = 2^s is chosen by the value-dependent rule: with e_i = k_i + c_i - 127
over the block's nonzero values (|v_i| = mu_i * 2^e_i) and delta_i = 1 when mu_i = 1.5, a
lossless s exists iff max e_i - min(e_i - delta_i) <= 17; s = max e_i - 8. It accepts every
block the scale-only rule (c_max - c_min <= 14) accepts, and more.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
# e2m1 code (low 3 bits) -> (k, delta) of |v| = mu * 2^k; code 0 is zero.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_K = torch.tensor([0, -1, 0, 0, 1, 1, 2, 2], dtype=torch.int32)
_DELTA = torch.tensor([0, 0, 0, 1, 0, 1, 0, 1], dtype=torch.int32)


@dataclass
class SpreadError(ValueError):
    """A block whose values cannot share one e4m3 scale losslessly."""
    row: int      # block row index (rows row*128 ..)
    col: int      # block column index
    spread: int   # max e_i - min(e_i - delta_i); lossless needs <= 17

    def __str__(self) -> str:
        return (f"block (row {self.row}, col {self.col}) has exponent spread {self.spread} > 17; "
                f"no single power-of-two scale holds its MXFP4 values exactly in e4m3")


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, K/2] uint8 (low nibble first) -> [R, K] e2m1 codes 0..15."""
    p = packed.to(torch.int32)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)


def decode(packed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 dequantization e2m1 * 2^(c - 127) of [R, K/2] nibbles with [R, K/32] E8M0."""
    nib = unpack(packed)
    mag = _E2M1[(nib & 7).long()]
    val = torch.where(nib >= 8, -mag, mag)
    exp = codes.to(torch.int32).repeat_interleave(32, dim=1) - 127
    return torch.ldexp(val, exp.to(torch.float32))


def _exponents(nib: torch.Tensor, codes: torch.Tensor):
    c = codes.to(torch.int32).repeat_interleave(32, dim=1)
    m = (nib & 7).long()
    e = _K[m] + c - 127
    return e, e - _DELTA[m], m != 0


def block_scale(nib: torch.Tensor, codes: torch.Tensor) -> int | None:
    """s for one block (nibbles [r, k], codes [r, k/32]); None when the block is all zero."""
    e, lo, nz = _exponents(nib, codes)
    if not bool(nz.any()):
        return None
    emax, emin = int(e[nz].max()), int(lo[nz].min())
    if emax - emin > 17:
        raise SpreadError(0, 0, emax - emin)
    return emax - 8


def reencode(packed: torch.Tensor, codes: torch.Tensor):
    """[R, K/2] MXFP4 + [R, K/32] E8M0 -> (e4m3fn [R, K], float32 scales [ceil(R/128), ceil(K/128)]).

    Raises SpreadError naming the first block that does not fit; asserts exactness of the cast."""
    nib = unpack(packed)
    rows, cols = nib.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    scales = torch.ones(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            r, k = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            kc = slice(j * BLOCK // 32, (j + 1) * BLOCK // 32)
            try:
                s = block_scale(nib[r, k], codes[r, kc])
            except SpreadError as err:
                raise SpreadError(i, j, err.spread) from None
            if s is not None:
                scales[i, j] = 2.0 ** s
    full = scales.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    ref = decode(packed, codes)
    q = (ref / full).to(torch.float8_e4m3fn)
    if not torch.equal(q.to(torch.float32) * full, ref):  # pragma: no cover - proven in §19.7
        raise AssertionError("e4m3 re-encoding not exact")
    return q, scales


def dequant(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [R, K] * block scales -> float32 (the verify side)."""
    rows, cols = q.shape
    full = scales.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.to(torch.float32) * full
