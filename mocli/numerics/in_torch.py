"""The number formats in torch: activation quantization as the target kernels do it, and FP8 and e2m1
source-weight dequantization: what verify's FP8 checks and the serving emulation (``mocli.serve``) use.
NVFP4 verify runs in numpy (``mocli.numerics.in_numpy``, held bit-equal to ``nvfp4_quant`` here by a test).

Both the reference and the kernel side quantize activations with these functions (it is an input
model, not what is being checked); the weights each side uses come from different files.
"""

from __future__ import annotations

import torch

from mocli.numerics import E2M1_MAX, E2M1_VALUES, FP8_MAX

FP8 = torch.float8_e4m3fn
_E2M1 = torch.tensor(E2M1_VALUES)
# Midpoints between neighbouring e2m1 magnitudes: bucketize gives the nearest code.
_MIDS = (_E2M1[1:] + _E2M1[:-1]) / 2


def fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8: q = fp8(x / scale) (what the kernel input must be)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: (q [T, K], scale [T, 1])."""
    s = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_per_group_dequant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Dynamic per-token-group (1 x 128) FP8, returned dequantized (float32)."""
    t, k = x.shape
    g = x.float().reshape(t, k // group, group)
    s = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return ((g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).reshape(t, k)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (float32), saturating at ±6."""
    mids = _MIDS.to(x.device)
    idx = torch.bucketize(x.abs().clamp(max=E2M1_MAX), mids)
    return torch.sign(x) * _E2M1.to(x.device)[idx]


def nvfp4_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation quantization as FlashInfer's fp4_quantize(x, global_scale) does it.

    Per 16-element block: sf = fp8(amax / 6 * gs); values e2m1(x * gs / sf). Returns the exact
    product e2m1 * sf (float32, exactly representable in bf16); the true value is that / gs.
    """
    t, k = x.shape
    gs = global_scale.float().reshape(()).to(x.device)
    b = x.float().reshape(t, k // 16, 16)
    sf = (b.abs().amax(dim=-1, keepdim=True) / E2M1_MAX * gs).clamp(max=FP8_MAX).to(FP8).float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    q = torch.where(sf > 0, e2m1_round(b * gs / safe), torch.zeros_like(b))
    return (q * sf).reshape(t, k)


# --- source-side dequantization (independent of mocli.plan / mocli.ops) ------------------------

_PAIRS: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """[256] int64 whose bits are the two float32 values of a byte's e2m1 codes (low nibble first)."""
    if device not in _PAIRS:
        codes = torch.arange(256)
        lo, hi = codes & 0x0F, codes >> 4
        sign = lambda c: torch.where(c >= 8, -1.0, 1.0)  # noqa: E731
        vals = torch.stack([sign(lo) * _E2M1[lo & 7], sign(hi) * _E2M1[hi & 7]], dim=1).float()
        _PAIRS[device] = vals.contiguous().view(torch.int64).reshape(256).to(device)
    return _PAIRS[device]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """U8 [N, K/2] -> float32 [N, K]; low nibble first, bit 3 sign. One table lookup per byte
    (int32 indices: building int64 ones cost more than the lookup)."""
    flat = packed.contiguous().reshape(-1)
    pairs = torch.index_select(_pair_table(flat.device), 0, flat.int())
    return pairs.view(torch.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequant_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor (0-dim or [1]), per-channel ([N] or [N, 1]) or 128x128 block ([N/128, 1, K/128, 1], or
    [ceil(N/128), ceil(K/128)]: a partial last block)."""
    w = q.float()
    s = scale.float().to(w.device)
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == w.shape[0] and (s.dim() == 1 or s.dim() == 2 and s.shape[1] == 1):
        return w * s.reshape(-1, 1)
    blocks = s.reshape(s.shape[0], s.shape[-2] if s.dim() == 4 else s.shape[1])
    full = blocks.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return w * full[:w.shape[0], :w.shape[1]]


def mxfp8_quant(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 dynamic activation quantization, dequantized (float32): per 32 values along the last dim an
    E8M0 scale 2^(ceil(log2(amax / 448))) (biased exponent clamped to 0..254), each value e4m3 of value /
    scale (vLLM 0.33 ``mxfp8_utils._mxfp8_e4m3_quantize_torch``, its emulation's reference)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2((torch.ceil(torch.log2(amax / FP8_MAX)) + 127.0).clamp(0, 254) - 127.0).unsqueeze(-1)
    return ((blocks / scale).to(FP8).float() * scale).reshape(x.shape)
