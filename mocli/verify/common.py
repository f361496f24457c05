"""What every verify check shares: options, the runtime (device, kernels, target layout), results,
the source on demand, problem lists, and the GEMM helpers (real kernels, or exact emulation).

The checks themselves mirror ``mocli.plan``: ``dense`` and ``moe`` (converted modules, per kind),
``quantized`` (``mocli quantize`` output); ``runner`` drives them.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from mocli.census import Census, Module
from mocli.devices import Kernels
from mocli.kinds import ModuleKind
from mocli.tables import WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import TargetLayout
from mocli.verify.expect import bit_equal
from mocli.verify.quant import FP8, dequant_fp8, dequant_nvfp4, unpack_e2m1


@dataclass
class VerifyOptions:
    source: str | None = None
    device: str = "auto"
    kernels: Kernels = Kernels.AUTO
    layers: str | None = None
    tokens: int = 64
    seed: int = 0
    rank: int | None = None
    check_source_hash: bool = True
    early_digests: Any = None  # a mocli.io.digests.BackgroundDigests started before torch (verify.early)


@dataclass(frozen=True)
class Thresholds:
    """Relative-error thresholds of one module kind (README "Thresholds" derives them): ``kept`` where
    the source's bits are kept, ``unified`` for shards or experts whose scales were unified; MoE:
    ``gemm2`` for GEMM2 fed with the kernel's own intermediate. Each is a few times what the format
    allows and far below the smallest real fault (a 2x scale error is 0.5-1.0, a w1/w3 swap 0.3)."""

    kept: float
    unified: float
    gemm2: float | None = None


THRESHOLDS: dict[ModuleKind, Thresholds] = {
    # requantizing non-max shards to the shared scale rounds each of their weights once more: half an
    # e4m3 step, 2^-4..2^-3 relative, rms <= 3.6% on those rows (real Llama export: 1.4-2.0%)
    ModuleKind.FP8_LINEAR: Thresholds(0.05, 0.05),
    # bit-identical weights: only BF16 output rounding (2^-9) and summation order remain
    ModuleKind.FP8_CHANNEL_LINEAR: Thresholds(0.01, 0.01),
    ModuleKind.FP8_BLOCK_LINEAR: Thresholds(0.01, 0.01),
    # shards whose weight_scale_2 was unified: one e4m3 rounding of each block scale, <= 2^-4 relative
    # per block (rms ~2.5%; measured 0.022-0.025), so a worst case of 2^-4 plus output rounding
    ModuleKind.NVFP4_LINEAR: Thresholds(0.01, 0.08),
    # MoE GEMM1 (x @ [w3; w1]) as the dense kinds; GEMM2 on the kernel's own intermediate: bit-identical
    # w2, output rounding only
    ModuleKind.FP8_MOE: Thresholds(0.05, 0.05, gemm2=0.01),
    ModuleKind.NVFP4_MOE: Thresholds(0.01, 0.08, gemm2=0.01),
}
# A fused FlashInfer MoE kernel gives only the layer output: the intermediate is re-quantized from
# slightly different values, so neighbouring codes flip (e2m1 codes are up to 33% apart).
FUSED_MOE_THRESHOLD = 0.10


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


@dataclass
class ModuleResult:
    module: str
    rank: int
    kind: str
    scheme: str
    kernel: str
    emulated: bool
    shape: dict[str, int]
    error: float
    threshold: float
    passed: bool
    seconds: float
    message: str = ""
    checks: dict[str, str] = field(default_factory=dict)  # bytes / consistency / numeric -> "ok" or why not
    stages: dict[str, float] = field(default_factory=dict)
    tensors: list[str] = field(default_factory=list)  # every tensor this check covered

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "tensors"}
        d["error"] = None if math.isnan(self.error) else self.error  # JSON has no NaN
        d["tensors_checked"] = len(self.tensors)
        return d



@dataclass
class CrossResult:
    """A cross-rank property of one module (SEMANTICS §10)."""

    module: str
    check: str
    error: float
    threshold: float
    passed: bool
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["error"] = None if math.isnan(self.error) else self.error
        return d


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
        if m.scheme is not None and m.scheme.value == "NVFP4":
            bs = scale.view(torch.uint8)[rows].view(scale.dtype) if rows is not None else scale
            return dequant_nvfp4(w.to(self.device), bs.to(self.device), self.scalar(m, WEIGHT_SCALE_2))
        if rows is not None and scale.dim() > 0:
            n = m.out_in[0]
            if scale.numel() == n:  # per channel
                scale = scale.reshape(-1)[rows]
            else:  # 128x128 blocks: the block row of each selected row, as a per-row block vector
                blocks = scale.reshape(n // 128, -1)[rows // 128]
                return (w.float() * blocks.repeat_interleave(128, dim=1)).to(self.device)
        return dequant_fp8(w.to(self.device), scale.to(self.device))


def gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return math.nan
    denom = float(ref.norm())
    return float((out - ref).norm()) / denom if denom > 0 else float((out - ref).norm())


class Halves(NamedTuple):
    """Decoded rows as a view (``TargetLayout.moe_rows_halves``): ``parts[k]``'s leading dims, read in
    order, are the rows of the k-th half (one part where nothing is gated)."""

    parts: torch.Tensor

    def rows(self) -> int:
        p = self.parts
        return p.shape[0] * (p[0].numel() // p.shape[-1] if p.shape[-1] else 0)


def _same_rows(view: torch.Tensor, rows: torch.Tensor) -> bool:
    """``rows`` ([n, cols]) has as many rows and columns as ``view``'s leading dims and last dim hold."""
    return rows.dim() == 2 and rows.shape[1] == view.shape[-1] and rows.numel() == view.numel()


class Problems(list):
    def expect_equal(self, what: str, got: torch.Tensor | Halves, want: torch.Tensor) -> None:
        if isinstance(got, Halves):
            self.expect_parts(what, got, [want])
        elif not bit_equal(got, want):
            self.append(f"{what} differs from the source")

    def expect_parts(self, what: str, got: torch.Tensor | Halves, parts: list[torch.Tensor]) -> None:
        """``got`` equals ``parts`` stacked on dim 0, compared block by block (no concatenation; a
        ``Halves`` part by part, the source's rows shaped as its view: nothing copied)."""
        if isinstance(got, Halves):
            if got.rows() != sum(p.shape[0] for p in parts):
                self.append(f"{what} has {got.rows()} rows, the source gives {sum(p.shape[0] for p in parts)}")
            elif len(parts) != got.parts.shape[0] or not all(
                    _same_rows(g, p) and bit_equal(g, p.reshape(g.shape)) for g, p in zip(got.parts, parts, strict=True)):
                self.append(f"{what} differs from the source")
            return
        if got.shape[0] != sum(p.shape[0] for p in parts):
            self.append(f"{what} has {got.shape[0]} rows, the source gives {sum(p.shape[0] for p in parts)}")
            return
        row = 0
        for p in parts:
            if not bit_equal(got[row:row + p.shape[0]], p):
                self.append(f"{what} differs from the source")
                return
            row += p.shape[0]

    def scalar(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        g, w = got.detach().float().cpu().reshape(-1), want.detach().float().cpu().reshape(-1)
        if g.shape != w.shape or not torch.equal(g.view(torch.int32), w.view(torch.int32)):
            self.append(f"{what} is {_few(g)}, SEMANTICS gives {_few(w)}")


def _few(t: torch.Tensor) -> str:
    vals = [f"{v:.6g}" for v in t[:3].tolist()]
    return "[" + ", ".join(vals) + (", ...]" if t.numel() > 3 else "]") if t.numel() != 1 else vals[0]



def finish(res: ModuleResult, problems: list[str], t0: float) -> ModuleResult:
    numeric_ok = not math.isnan(res.error) and res.error <= res.threshold
    res.checks = {"bytes+consistency": "ok" if not problems else "; ".join(problems[:3])
                  + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""),
                  "numeric": "ok" if numeric_ok else ("not run" if res.kernel == "layout check" else
                                                      "output is not finite" if math.isnan(res.error) else
                                                      f"relative error {res.error:.3g} > {res.threshold:g}")}
    res.passed = numeric_ok and not problems
    if not res.passed:
        res.message = "; ".join(v for v in res.checks.values() if v != "ok")
    res.seconds = round(time.perf_counter() - t0, 4)
    return res


# Numeric GEMMs per MoE layer. Every expert's bytes and scales are checked exactly regardless, so an
# expert's numbers follow from its bytes; the GEMMs exercise the kernel's reading of them (half order,
# scales, intermediate quantization), which a layer-wide fault breaks for every expert alike. Where
# one call covers every expert (FP8's grouped GEMM on CUDA) all run; where experts go one by one
# (emulated NVFP4: about 15 ms each on an H200, a second of a 6-layer, 64-expert verify) the first and
# seeded others.
CPU_SAMPLE_EXPERTS = 2
CUDA_SAMPLE_EXPERTS = 8


def sample_experts(n: int, rt: Runtime, opts, name: str, every: bool = False) -> list[int]:
    """Experts that get GEMMs: all when ``every`` (one call covers them), else the first and seeded
    others, the same on every rank (seeded by the layer's name)."""
    k = CUDA_SAMPLE_EXPERTS if rt.cuda else CPU_SAMPLE_EXPERTS
    if every or n <= k:
        return list(range(n))
    rest = torch.randperm(n - 1, generator=gen(opts.seed, name + "/experts"))[: k - 1] + 1
    return sorted({0, *rest.tolist()})


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



def scaled_e2m1(packed: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """e2m1 values times their fp8 block scale (float32 [N, K]): exactly representable in BF16."""
    vals = unpack_e2m1(packed)
    n, k = vals.shape
    return (vals.view(n, k // 16, 16) * block_scales.view(FP8).float().view(n, k // 16, 1)).view(n, k)



def gemm(a: torch.Tensor, b: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """a @ b.T of exactly representable values: BF16 tensor cores on CUDA, float32 on the CPU
    (where BF16 matmuls are slow and no more exact)."""
    if rt.cuda:
        return (a.bfloat16() @ b.bfloat16().T).float()
    return a.float() @ b.float().T



def single_rank_report(out, src, target: str, rt: Runtime, opts, results: list[ModuleResult], files_checked: int,
                       file_problems: list, kept: int, problems: list, tensors: int, unchecked: list, note: str,
                       t0: float) -> dict[str, Any]:
    """The report of an output with one rank and no cross-rank checks (quantize and repair outputs), in
    the shape of convert's, so renderers, JUnit and HTML read all three alike."""
    failed = [r for r in results if not r.passed]
    return {
        "output": str(out), "source": src.source.describe(), "target": target,
        "parallel": {"tp": 1, "ep": 1, "ranks": 1}, "ranks": [0], "device": str(rt.device), "tokens": opts.tokens,
        "seed": opts.seed, "files": {"checked": files_checked, "problems": file_problems},
        "modules": [r.to_dict() for r in results], "cross_rank": [],
        "passthrough": {"checked": kept, "problems": problems},
        "coverage": {"tensors": tensors, "unchecked": unchecked, "note": note},
        "passed": len(results) - len(failed),
        "failed": len(failed) + len(file_problems) + len(problems) + len(unchecked),
        "ok": not (failed or file_problems or problems or unchecked), "seconds": round(time.perf_counter() - t0, 3),
    }
