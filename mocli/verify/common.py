"""What the torch checks share: the runtime (device, kernels, target layout) and the GEMM helpers (real
kernels, or exact emulation). The torch-free pieces (options, thresholds, results, problem lists) are
``mocli.verify.results``, re-exported here; the source is ``mocli.verify.source``.

The module checks are ``mocli.verify.kinds`` (one module per converted module kind), ``quantized`` and
``repaired`` check the outputs of ``mocli quantize`` and ``mocli repair``; ``runner`` drives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mocli.devices import Kernels
from mocli.targets import TargetLayout
from mocli.verify.results import (  # noqa: F401 - the torch checks import these from here
    CPU_SAMPLE_EXPERTS,
    CUDA_SAMPLE_EXPERTS,
    FUSED_MOE_THRESHOLD,
    THRESHOLDS,
    CrossResult,
    Halves,
    ModuleResult,
    Problems,
    Tally,
    VerifyOptions,
    finish,
    pick_experts,
    rel_error,
    seed_of,
    single_rank_report,
)


@dataclass
class Runtime:
    device: torch.device
    kernels: Kernels
    layout: TargetLayout | None  # None: quantize output (no kernel layout)
    cc: tuple[int, int] | None = None
    fi: Any = None  # the flashinfer module when usable

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def fp4_kernels(self) -> bool:
        """FlashInfer NVFP4 kernels: sm_100+ only (SEMANTICS §9), for a layout they read."""
        return (self.fi is not None and self.cuda and self.cc is not None and self.cc[0] >= 10
                and self.kernels is not Kernels.TORCH and self.layout is not None and self.layout.fp4_kernels)


def runtime(opts: VerifyOptions, layout: TargetLayout | None) -> Runtime:
    """Where the checks run and which kernels they may call."""
    from mocli.devices import resolve_device
    from mocli.errors import InputError

    rt = Runtime(resolve_device(opts.device), Kernels(opts.kernels), layout)
    if rt.cuda:
        rt.cc = torch.cuda.get_device_capability(rt.device)
    if rt.kernels is not Kernels.TORCH and rt.cuda:  # FlashInfer kernels are CUDA-only: skip the (slow) import
        try:
            import flashinfer

            rt.fi = flashinfer
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            rt.fi = None
    if rt.kernels is Kernels.FLASHINFER and (rt.fi is None or not rt.cuda):
        raise InputError("--kernels flashinfer needs flashinfer-python and a CUDA device",
                         hint="pip install 'mocli[flashinfer]' on a GPU machine, or use --kernels torch")
    return rt


def gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(seed, name))


def sample_experts(n: int, rt: Runtime, opts, name: str, every: bool = False) -> list[int]:
    """Experts that get GEMMs: all when ``every`` (one call covers them), else ``pick_experts``."""
    k = CUDA_SAMPLE_EXPERTS if rt.cuda else CPU_SAMPLE_EXPERTS
    return list(range(n)) if every else pick_experts(n, k, opts.seed, name)


# --- GEMMs -------------------------------------------------------------------------------------------

def rows_of(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of any 1-byte or wider tensor (index_select has no float8 kernel on every device)."""
    if t.element_size() == 1:
        return t.view(torch.uint8)[rows.to(t.device)].view(t.dtype)
    return t[rows.to(t.device)]


def _pad16(t: torch.Tensor, rows: int, cols: int, fill: float = 0.0) -> torch.Tensor:
    """``t`` grown to ``rows`` x ``cols`` with ``fill`` (1-byte float8 tensors padded as bytes: 0x00 is 0.0)."""
    if tuple(t.shape) == (rows, cols):
        return t
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return _pad16(t.view(torch.uint8), rows, cols).view(t.dtype)
    out = torch.full((rows, cols), fill, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def scaled_mm(xq: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm(xq, w.T)`` in float32 for any N and K: cuBLASLt wants both multiples of 16, so
    zero rows/columns are added (they add nothing to a dot product) and cut off again. ``scale_b`` is
    a scalar or one scale per row of ``w``."""
    n, k = w.shape
    n16, k16 = -(-n // 16) * 16, -(-k // 16) * 16
    xq, w = _pad16(xq, xq.shape[0], k16), _pad16(w, n16, k16)
    if scale_b.numel() > 1:
        scale_b = _pad16(scale_b.reshape(1, -1), 1, n16, 1.0)
    return torch._scaled_mm(xq, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16).float()[:, :n]
