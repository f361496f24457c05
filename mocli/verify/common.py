"""What the torch checks share: the runtime (device, kernels, target layout), the source on demand,
and the GEMM helpers (real kernels, or exact emulation). The torch-free pieces (options, thresholds,
results, problem lists) are ``mocli.verify.results``, re-exported here.

The checks themselves mirror ``mocli.plan``: ``dense`` and ``moe`` (FP8 converted modules, per kind),
``nvfp4`` (NVFP4 ones, in numpy), ``quantized`` (``mocli quantize`` output); ``runner`` drives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mocli.census import Census, Module
from mocli.devices import Kernels
from mocli.numerics.in_torch import dequant_fp8
from mocli.tables import WEIGHT, WEIGHT_SCALE
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


class Source:
    """Source tensors on demand, on the verify device."""

    def __init__(self, ckpt, census: Census, reader, device: torch.device) -> None:
        self.ckpt, self.census, self.reader, self.device = ckpt, census, reader, device
        self.layers = {layer.name: layer for layer in census.moe}
        self.fetched: dict[str, torch.Tensor] = {}  # on the verify device, inside on_device()

    def t(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        return self.near(name).to(device or self.device)

    def cpu(self, name: str) -> torch.Tensor:
        """A copy-free view of the source tensor's bytes (page cache)."""
        return self.reader.view(self.ckpt.tensors[name])

    def near(self, name: str) -> torch.Tensor:
        """The tensor on the verify device if on_device() put it there, else the page-cache view."""
        t = self.fetched.get(name)
        return t if t is not None else self.cpu(name)

    @contextmanager
    def on_device(self, names: list[str]) -> Iterator[None]:
        """CUDA: these tensors (a MoE layer's expert weights and block scales) on the device while the
        block runs, read in one span per file through pinned staging (mocli.loader.load_tensors) instead
        of one pageable copy per tensor and use; ``near`` hands them out. Files where the names are
        scattered (span over twice their bytes) are left to the per-tensor path."""
        if self.device.type != "cuda":
            yield
            return
        from mocli.loader import load_tensors

        by_file: dict = {}
        for n in names:
            e = self.ckpt.tensors[n]
            by_file.setdefault(e.file, []).append(e)
        bulk = [e for es in by_file.values()
                if max(e.start + e.nbytes for e in es) - min(e.start for e in es) <= 2 * sum(e.nbytes for e in es)
                for e in es]
        self.fetched = load_tensors(bulk, self.device, follow=True)
        try:
            yield
        finally:
            self.fetched = {}  # one layer's source bytes on the device at a time

    def module(self, name: str) -> Module:
        return self.census.modules[name]

    def scalar(self, m: Module, suffix: str) -> torch.Tensor:
        return self.cpu(m.tensors[suffix].name).float().reshape(())

    def dequant(self, m: Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] of one source linear (or its ``rows``), from its own scales."""
        w = self.near(m.tensors[WEIGHT].name)
        scale = self.near(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w = w.view(torch.uint8)[rows].view(w.dtype)
        if rows is not None and scale.dim() > 0:
            n = m.out_in[0]
            if scale.numel() == n:  # per channel
                scale = scale.reshape(-1)[rows]
            else:  # 128x128 blocks: the block row of each selected row, as a per-row block vector
                blocks = scale.reshape(n // 128, -1)[rows // 128]
                return (w.float() * blocks.repeat_interleave(128, dim=1)).to(self.device)
        return dequant_fp8(w.to(self.device), scale.to(self.device))


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
