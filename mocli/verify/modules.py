"""Per-module checks of one rank: bytes, consistency and kernel numerics.

- bytes: every weight and block-scale byte, decoded with the target's inverse transforms, equals
  what the source implies (``mocli.verify.expect``); checked for every expert, not a sample.
- consistency: every scale and derived scalar equals its SEMANTICS formula over the source scales,
  bit for bit (a doubled ``w13_weight_scale`` that no kernel check reads is caught here).
- numeric: real GEMMs (or the emulation, where the format has no kernel here) on the converted
  tensors against a float32 reference from the source. MoE is checked stage by stage: GEMM1
  against the source, GEMM2 fed with the kernel's own quantized intermediate, so saturation of the
  intermediate format (a property of the scales, not of the layout) cannot read as a fault.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mocli.census import Census, Module
from mocli.errors import CorruptFileError
from mocli.kinds import ModuleKind, Role
from mocli.loader import ConvertedCheckpoint
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import TargetLayout
from mocli.targets.decode import LayoutError, unswizzle
from mocli.verify import flashinfer_args
from mocli.verify.expect import apply_table, bit_equal, rule_slices
from mocli.verify.quant import (
    FP8,
    dequant_fp8,
    dequant_nvfp4,
    fp8_per_group_dequant,
    fp8_per_token,
    fp8_static,
    nvfp4_quant,
    unpack_e2m1,
)

# Relative-error thresholds (README "Thresholds" derives them). Each is a few times what the format
# itself allows and far below the smallest real fault (a 2x scale error is 0.5-1.0, a w1/w3 swap 0.3).
THRESHOLDS: dict[str, float] = {
    # requantizing non-max shards to the shared scale rounds each of their weights once more: half an
    # e4m3 step, 2^-4..2^-3 relative, rms <= 3.6% on those rows (real Llama export: 1.4-2.0%)
    "fp8_linear": 0.05,
    # bit-identical weights: only BF16 output rounding (2^-9) and summation order remain
    "fp8_channel_linear": 0.01,
    "fp8_block_linear": 0.01,
    "nvfp4_linear": 0.01,
    # shards whose weight_scale_2 was unified: one e4m3 rounding of each block scale, <= 2^-4 relative
    # per block (rms ~2.5%; measured 0.022-0.025), so a worst case of 2^-4 plus output rounding
    "nvfp4_linear_rescaled": 0.08,
    # MoE GEMM1 (x @ [w3; w1]): FP8 as fp8_linear; NVFP4 as nvfp4_linear(_rescaled)
    "fp8_moe_gemm1": 0.05,
    "nvfp4_moe_gemm1": 0.01,
    "nvfp4_moe_gemm1_rescaled": 0.08,
    # MoE GEMM2 on the kernel's own intermediate: bit-identical w2, output rounding only
    "fp8_moe_gemm2": 0.01,
    "nvfp4_moe_gemm2": 0.01,
    # a fused FlashInfer MoE kernel gives only the layer output: the intermediate is re-quantized
    # from slightly different values, so neighbouring codes flip (e2m1 codes are up to 33% apart)
    "fused_moe": 0.10,
}
# Numeric GEMMs per MoE layer on the CPU. Every expert's bytes and scales are checked exactly
# regardless; the GEMMs exercise the kernel's reading of them (half order, scales, intermediate
# quantization), which a layer-wide fault breaks for every expert alike. CUDA runs all of them.
CPU_SAMPLE_EXPERTS = 2


@dataclass
class Runtime:
    device: torch.device
    kernels: str
    target: str
    layout: TargetLayout
    cc: tuple[int, int] | None = None
    fi: Any = None  # the flashinfer module when usable

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def fp4_kernels(self) -> bool:
        """FlashInfer NVFP4 kernels: sm_100+ only (SEMANTICS §9), cutlass layout only (trtllm: emulated)."""
        return (self.fi is not None and self.cuda and self.cc is not None and self.cc[0] >= 10
                and self.kernels != "torch" and self.target == "flashinfer-cutlass")


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


class Source:
    """Source tensors on demand, on the verify device."""

    def __init__(self, ckpt, census: Census, reader, device: torch.device) -> None:
        self.ckpt, self.census, self.reader, self.device = ckpt, census, reader, device
        self.layers = {layer.name: layer for layer in census.moe}

    def t(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        return self.reader.view(self.ckpt.tensors[name]).to(device or self.device)

    def cpu(self, name: str) -> torch.Tensor:
        """A copy-free view of the source tensor's bytes (page cache)."""
        return self.reader.view(self.ckpt.tensors[name])

    def module(self, name: str) -> Module:
        return self.census.modules[name]

    def scalar(self, m: Module, suffix: str) -> torch.Tensor:
        return self.cpu(m.tensors[suffix].name).float().reshape(())

    def dequant(self, m: Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] of one source linear (or its ``rows``), from its own scales."""
        w = self.cpu(m.tensors[WEIGHT].name)
        scale = self.cpu(m.tensors[WEIGHT_SCALE].name)
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


class _Problems(list):
    def expect_equal(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not bit_equal(got, want):
            self.append(f"{what} differs from the source")

    def expect_parts(self, what: str, got: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """``got`` equals ``parts`` stacked on dim 0, compared block by block (no concatenation)."""
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


# --- dense linears ---------------------------------------------------------------------------------

NUMERIC_ROWS = 512  # output rows per dense module that get GEMMs (every row's bytes are compared)


def _rows_of(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
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


class _DenseKind:
    """What differs between dense kinds: activation model, byte/scale expectations, the kernel."""

    threshold: float
    x_scale: float = 1.0

    def __init__(self, shards: list[Module], src: Source, rt: Runtime) -> None:
        self.shards, self.src, self.rt = shards, src, rt

    def quant(self, x: torch.Tensor) -> torch.Tensor:
        """The activations as the kernel quantizes them, dequantized (float32)."""
        raise NotImplementedError

    def check(self, mod, slices: list[list[int]], problems: _Problems) -> None:
        raise NotImplementedError

    def kernel(self, mod, xr: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, str, bool]:
        """The kernel's output for the rank's output ``rows`` (local indices)."""
        raise NotImplementedError

    def weights(self, slices) -> list[torch.Tensor]:
        return [self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0:c1]
                for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)]


class _Fp8Linear(_DenseKind):
    threshold = THRESHOLDS["fp8_linear"]

    def __init__(self, shards, src, rt) -> None:
        super().__init__(shards, src, rt)
        self.s = [src.scalar(m, WEIGHT_SCALE) for m in shards]
        self.big_s = torch.stack(self.s).max()
        self.big_a = torch.stack([src.scalar(m, INPUT_SCALE) for m in shards]).max()
        self.x_scale = float(self.big_a) * 448 / 4

    def quant(self, x):
        return fp8_static(x, self.big_a).float() * self.big_a.to(x.device)

    def check(self, mod, slices, problems) -> None:
        problems.scalar("weight_scale", mod.weight_scale, self.big_s)
        problems.scalar("input_scale", mod.input_scale, self.big_a)
        problems.expect_parts("weight", mod.weight, [
            apply_table("requant", self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0:c1], si, self.big_s)
            for m, si, (r0, r1, c0, c1) in zip(self.shards, self.s, slices, strict=True)])

    def kernel(self, mod, xr, rows):
        xq = fp8_static(xr, mod.input_scale)
        out = scaled_mm(xq, _rows_of(mod.weight, rows), mod.input_scale.float(), mod.weight_scale.float())
        return out, "torch._scaled_mm", False


class _Fp8Channel(_DenseKind):
    threshold = THRESHOLDS["fp8_channel_linear"]

    def quant(self, x):
        q, s = fp8_per_token(x)
        return q.float() * s

    def check(self, mod, slices, problems) -> None:
        problems.expect_parts("weight", mod.weight, self.weights(slices))
        row_split = slices[0][2] != 0 or slices[0][3] != self.shards[0].out_in[1]
        scales = [self.src.cpu(m.tensors[WEIGHT_SCALE].name).reshape(-1) for m in self.shards]
        problems.scalar("weight_scale", mod.weight_scale, torch.cat(
            scales if row_split else [sc[r0:r1] for sc, (r0, r1, _, _) in zip(scales, slices, strict=True)]))

    def kernel(self, mod, xr, rows):
        xq, xs = fp8_per_token(xr)
        w, ws = _rows_of(mod.weight, rows), mod.weight_scale.float()[rows.to(xr.device)]
        try:
            return scaled_mm(xq, w, xs, ws), "torch._scaled_mm (rowwise)", False
        except (RuntimeError, NotImplementedError):
            return (xq.float() * xs) @ (w.float() * ws.reshape(-1, 1)).T, "emulated (dequantized FP8, float32 GEMM)", True


class _Fp8Block(_DenseKind):
    threshold = THRESHOLDS["fp8_block_linear"]

    def quant(self, x):
        return fp8_per_group_dequant(x)

    def check(self, mod, slices, problems) -> None:
        problems.expect_parts("weight", mod.weight, self.weights(slices))
        k = self.shards[0].out_in[1]
        problems.scalar("weight_scale", mod.weight_scale, torch.cat([
            self.src.cpu(m.tensors[WEIGHT_SCALE].name).reshape(-1, k // 128)[r0 // 128:r1 // 128, c0 // 128:c1 // 128]
            for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)]))

    def kernel(self, mod, xr, rows):
        dev_rows = rows.to(xr.device)
        s = mod.weight_scale.float()[dev_rows // 128].repeat_interleave(128, 1)
        return (fp8_per_group_dequant(xr) @ (_rows_of(mod.weight, rows).float() * s).T,
                "emulated (dequantized FP8 128x128 blocks, float32 GEMM)", True)


class _Nvfp4Linear(_DenseKind):
    def __init__(self, shards, src, rt) -> None:
        super().__init__(shards, src, rt)
        self.s2 = [src.scalar(m, WEIGHT_SCALE_2) for m in shards]
        self.big_s2 = torch.stack(self.s2).max()
        self.big_a = torch.stack([src.scalar(m, INPUT_SCALE) for m in shards]).max()
        rescaled = any(float(x) != float(self.big_s2) for x in self.s2)
        self.threshold = THRESHOLDS["nvfp4_linear_rescaled" if rescaled else "nvfp4_linear"]
        self.x_scale = float(self.big_a) * 2688 / 4

    def quant(self, x):
        return nvfp4_quant(x, 1 / self.big_a) * self.big_a.to(x.device)

    def check(self, mod, slices, problems) -> None:
        layout, n, k = self.rt.layout, mod.n, mod.k
        problems.scalar("weight_scale_2", mod.weight_scale_2, self.big_s2)
        problems.scalar("input_scale", mod.input_scale, self.big_a)
        problems.scalar("alpha", mod.alpha, self.big_a * self.big_s2)
        problems.scalar("input_scale_inv", mod.input_scale_inv, torch.reciprocal(self.big_a))
        self.w = layout.nvfp4_weight_decode(mod.weight, n, k, f"{mod.name}.weight")
        self.bs = layout.nvfp4_scale_decode(mod.weight_scale, n, k // 16, f"{mod.name}.weight_scale")
        problems.expect_parts("weight", self.w, [self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0 // 2:c1 // 2]
                                                 for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])
        problems.expect_parts("weight_scale (block scales)", self.bs, [
            apply_table("rescale", self.src.cpu(m.tensors[WEIGHT_SCALE].name)[r0:r1, c0 // 16:c1 // 16], si, self.big_s2)
            for m, si, (r0, r1, c0, c1) in zip(self.shards, self.s2, slices, strict=True)])

    def kernel(self, mod, xr, rows):
        if self.rt.fp4_kernels():
            return flashinfer_args.run_mm_fp4(self.rt.fi, mod, xr)[:, rows.to(xr.device)], "flashinfer.mm_fp4", False
        dev = xr.device
        xa = nvfp4_quant(xr, mod.input_scale_inv)  # e2m1 * sf: exact in float32 and bf16
        wb = _scaled_e2m1(self.w[rows].to(dev), self.bs[rows].to(dev))
        return _gemm(xa, wb, self.rt) * mod.alpha.float(), "emulated NVFP4 (decoded layout, exact products)", True


DENSE: dict[ModuleKind, type[_DenseKind]] = {
    ModuleKind.FP8_LINEAR: _Fp8Linear, ModuleKind.FP8_CHANNEL_LINEAR: _Fp8Channel,
    ModuleKind.FP8_BLOCK_LINEAR: _Fp8Block, ModuleKind.NVFP4_LINEAR: _Nvfp4Linear,
}


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


def _sample_rows(shards: list[Module], opts, name: str) -> torch.Tensor:
    """Full-layer output rows that get GEMMs: each shard's first and last row plus seeded others."""
    n = sum(m.out_in[0] for m in shards)
    if n <= NUMERIC_ROWS:
        return torch.arange(n)
    edges = {e for off, m in zip(_offsets(shards), shards, strict=True) for e in (off, off + m.out_in[0] - 1)}
    pick = torch.randperm(n, generator=gen(opts.seed, name + "/rows"))[: NUMERIC_ROWS - len(edges)]
    return torch.tensor(sorted(edges | set(pick.tolist())))


def check_dense(name: str, infos: dict[int, dict], cks: dict[int, ConvertedCheckpoint], src: Source, rt: Runtime,
                opts, tp: int, heads) -> tuple[list[ModuleResult], CrossResult | None]:
    """One dense module on every given rank, then (all ranks given) the column-concat / row-sum
    property. Bytes are compared for every row; GEMMs run on up to NUMERIC_ROWS sampled rows."""
    first = next(iter(infos.values()))
    kind = ModuleKind(first["kind"])
    shards = [src.module(n) for n in first["sources"]]
    case = DENSE[kind](shards, src, rt)
    k_full = shards[0].out_in[1]
    x = (torch.randn(opts.tokens, k_full, generator=gen(opts.seed, name)) * case.x_scale).to(rt.device)
    sample = _sample_rows(shards, opts, name)  # sorted full-layer rows
    offsets = _offsets(shards)
    parts = []
    for m, off in zip(shards, offsets, strict=True):
        local = sample[(sample >= off) & (sample < off + m.out_in[0])] - off
        if len(local):
            parts.append(src.dequant(m, local))
    w_sample = torch.cat(parts)  # source weights of the sampled rows, float32 [S, K]
    bias_full = torch.cat([src.cpu(m.tensors["bias"].name) for m in shards]).float() if "bias" in shards[0].tensors \
        else None
    results, outs = [], {}
    for rank, info in infos.items():
        t0 = time.perf_counter()
        meta = info["meta"]
        slices = meta.get("slices") or [[0, m.out_in[0], 0, m.out_in[1]] for m in shards]
        split = meta.get("split", "replicated")
        res = ModuleResult(name, rank, str(kind), info["scheme"], "", False,
                           {k: v for k, v in meta.items() if isinstance(v, int)}, math.nan, case.threshold, False, 0.0,
                           tensors=list(info["tensors"].values()))
        problems = _Problems()
        expected = rule_slices(info, shards, tp, heads)
        if expected is not None and expected != slices:
            problems.append(f"the manifest's slices {slices} are not SEMANTICS §10's {expected}")
        try:
            mod = cks[rank].load_module(name, rt.device)
            case.check(mod, slices, problems)
            c0, c1 = slices[0][2], slices[0][3]
            held = torch.cat([torch.arange(a, b) + off for (a, b, _, _), off in zip(slices, offsets, strict=True)])
            keep = torch.isin(held, sample)
            local_rows = keep.nonzero().reshape(-1)  # the rank's rows (local) that were sampled
            global_rows = held[local_rows]
            cols = torch.searchsorted(sample, global_rows)  # their place among the sampled rows
            xr = x[:, c0:c1]
            out, res.kernel, res.emulated = case.kernel(mod, xr, local_rows)
            xq_r = case.quant(xr)
            if split == "row":
                ref = xq_r @ w_sample[:, c0:c1].to(xq_r.device).T
            else:
                ref = (case.quant(x) @ w_sample.to(x.device).T)[:, cols.to(x.device)]
            if getattr(mod, "bias", None) is not None:
                problems.expect_parts("bias", mod.bias, [src.cpu(m.tensors["bias"].name)[a:e]
                                                         for m, (a, e, _, _) in zip(shards, slices, strict=True)])
                # the engine adds a row-parallel bias once, after the all-reduce: rank 0 carries it here
                if split != "row" or meta.get("tp_rank", 0) == 0:
                    out = out + mod.bias.float()[local_rows.to(out.device)]
                    ref = ref + bias_full.to(ref.device)[global_rows.to(ref.device)]
            res.error = rel_error(out, ref)
            outs[rank] = (split, cols, xq_r, out, meta.get("tp_rank", 0))
        except (LayoutError, CorruptFileError) as e:
            res.kernel = "layout check"
            problems.insert(0, str(e))
        results.append(_finish(res, problems, t0))
    cross = None
    if len(outs) > 1 and len(outs) == len(infos):
        cross = _dense_cross(name, outs, x, case, w_sample, None if bias_full is None else bias_full[sample])
    return results, cross


def _dense_cross(name, outs, x, case, w_sample, bias_sample) -> CrossResult:
    """Combine the ranks' kernel outputs as the engine does and compare with the whole layer (on the
    sampled rows). Ranks that share a tp rank (expert-parallel replicas) must agree and count once."""
    split = next(iter(outs.values()))[0]
    by_tp: dict[int, tuple] = {}
    for rank in sorted(outs):
        _, cols, xq, out, t = outs[rank]
        if t in by_tp and not torch.equal(by_tp[t][2], out):
            return CrossResult(name, "replica ranks agree", math.nan, 0.0, False,
                               f"ranks holding tp rank {t} give different outputs")
        by_tp.setdefault(t, (cols, xq, out))
    w = w_sample.to(x.device)
    if split == "row":
        check = "row-parallel rank outputs sum to the full layer"
        got = sum(out for _, _, out in by_tp.values())
        # ranks hold consecutive column blocks in tp-rank order; their quantized inputs side by side
        ref = torch.cat([by_tp[t][1] for t in sorted(by_tp)], dim=1) @ w.T
    else:
        check = ("column-parallel rank outputs concatenate to the full layer" if split == "column"
                 else "replicated ranks each equal the full layer")
        got = torch.full((x.shape[0], w.shape[0]), math.nan, device=w.device)
        for cols, _, out in by_tp.values():
            c = cols.to(got.device)
            held = ~torch.isnan(got[:, c])
            if bool(held.any()) and not torch.equal(got[:, c][held], out[held]):
                return CrossResult(name, check, math.nan, case.threshold, False, "replicated rows differ between ranks")
            got[:, c] = out
        ref = case.quant(x) @ w.T
    if bias_sample is not None:  # the ranks' outputs carry the bias (row-parallel: rank 0 only)
        ref = ref + bias_sample.to(ref.device)
    err = math.nan if bool(torch.isnan(got).any()) else rel_error(got, ref)
    passed = not math.isnan(err) and err <= case.threshold
    return CrossResult(name, check, err, case.threshold, passed, "" if passed else
                       ("some rows are held by no rank" if math.isnan(err) else f"relative error {err:.3g} > "
                        f"{case.threshold:g}"))


def _offsets(shards: list[Module]) -> list[int]:
    offs, off = [], 0
    for m in shards:
        offs.append(off)
        off += m.out_in[0]
    return offs


def _scaled_e2m1(packed: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """e2m1 values times their fp8 block scale (float32 [N, K]): exactly representable in BF16."""
    vals = unpack_e2m1(packed)
    n, k = vals.shape
    return (vals.view(n, k // 16, 16) * block_scales.view(FP8).float().view(n, k // 16, 1)).view(n, k)


def _gemm(a: torch.Tensor, b: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """a @ b.T of exactly representable values: BF16 tensor cores on CUDA, float32 on the CPU
    (where BF16 matmuls are slow and no more exact)."""
    if rt.cuda:
        return (a.bfloat16() @ b.bfloat16().T).float()
    return a.float() @ b.float().T


# --- MoE --------------------------------------------------------------------------------------------------

def check_moe(name: str, infos: dict[int, dict], cks: dict[int, ConvertedCheckpoint], src: Source, rt: Runtime,
              opts) -> tuple[list[ModuleResult], CrossResult | None]:
    """One MoE layer on every given rank: bytes of every expert, consistency, stage-wise numerics on a
    sample of experts; then (tensor parallel, all ranks) the concatenation / sum over ranks."""
    first = next(iter(infos.values()))
    kind = ModuleKind(first["kind"])
    fp4 = kind is ModuleKind.NVFP4_MOE
    layer = src.layers[name]
    every = [layer.experts[e] for e in sorted(layer.experts)]
    a13 = torch.stack([torch.maximum(src.scalar(e.gate, INPUT_SCALE), src.scalar(e.up, INPUT_SCALE)) for e in every]).max()
    a2 = torch.stack([src.scalar(e.down, INPUT_SCALE) for e in every]).max()
    h = layer.hidden
    x = (torch.randn(opts.tokens, h, generator=gen(opts.seed, name)) * (float(a13) * (448 * 6 if fp4 else 448) / 4)
         ).to(rt.device)
    a13d = a13.to(rt.device)
    ref_in = (nvfp4_quant(x, 1 / a13d) * a13d) if fp4 else fp8_static(x, a13d).float() * a13d
    weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def source(gid: int):  # dequantized w1, w3, w2 of a global expert, once per module
        if gid not in weights:
            ex = layer.experts[gid]
            weights[gid] = (src.dequant(ex.gate), src.dequant(ex.up), src.dequant(ex.down))
        return weights[gid]

    results, per_rank = [], {}
    for rank, info in infos.items():
        t0 = time.perf_counter()
        meta = info["meta"]
        res = ModuleResult(name, rank, str(kind), info["scheme"], "", False,
                           {k: v for k, v in meta.items() if isinstance(v, int)}, math.nan, 0.0, False, 0.0,
                           tensors=list(info["tensors"].values()))
        problems = _Problems()
        try:
            mod = cks[rank].load_module(name, rt.device)
            off = meta.get("expert_offset", 0)
            i_slice = tuple(meta.get("intermediate_slice", [0, meta["intermediate"]]))
            experts = [layer.experts[off + e] for e in range(mod.experts)]
            _moe_consistency(mod, kind, experts, a13, a2, src, problems)
            for local, ex in enumerate(experts):
                _moe_bytes(mod, local, ex, i_slice, fp4, src, rt, problems)
            if rt.fi is not None and rt.kernels == "flashinfer" or (fp4 and rt.fp4_kernels()):
                res.kernel, res.emulated, res.stages, (res.error, res.threshold) = _moe_fused(
                    mod, experts, x, ref_in, a2.to(rt.device), fp4, src, rt, opts)
            else:
                res.kernel, res.emulated, res.stages, (res.error, res.threshold), outs = _moe_stages(
                    mod, experts, off, i_slice, fp4, x, ref_in, source, src, rt, opts)
                per_rank[rank] = (i_slice, outs)
        except (LayoutError, CorruptFileError) as e:
            res.kernel = "layout check"
            problems.insert(0, str(e))
        results.append(_finish(res, problems, t0))
    cross = None
    if len({i_slice for i_slice, _ in per_rank.values()}) > 1 and len(per_rank) == len(infos):
        cross = _moe_cross(name, per_rank, x, ref_in, source, layer.intermediate, fp4)
    return results, cross


def _moe_consistency(mod, kind, experts, a13, a2, src: Source, problems: _Problems) -> None:
    """Every scale vector of the layer against SEMANTICS §4/§7 over the source's scales."""
    e = len(experts)
    suffix = WEIGHT_SCALE_2 if kind is ModuleKind.NVFP4_MOE else WEIGHT_SCALE
    s1, s3, s2 = (torch.stack([src.scalar(getattr(ex, p), suffix) for ex in experts]) for p in ("gate", "up", "down"))
    w13 = torch.maximum(s1, s3)
    g1, g2 = w13 * a13, s2 * a2
    if kind is ModuleKind.FP8_MOE:
        want = {Role.W13_WEIGHT_SCALE: w13, Role.W2_WEIGHT_SCALE: s2, Role.W13_INPUT_SCALE: a13,
                Role.W2_INPUT_SCALE: a2, Role.W13_INPUT_SCALE_INV: torch.reciprocal(a13),
                Role.W2_INPUT_SCALE_INV: torch.reciprocal(a2), Role.G1_ALPHAS: g1, Role.G2_ALPHAS: g2,
                Role.OUTPUT1_SCALES_SCALAR: g1 * torch.reciprocal(a2), Role.OUTPUT1_SCALES_GATE_SCALAR: g1,
                Role.OUTPUT2_SCALES_SCALAR: g2}
    else:
        a13_v, a2_v = a13.expand(e), a2.expand(e)
        want = {Role.W13_WEIGHT_SCALE_2: w13, Role.W2_WEIGHT_SCALE_2: s2, Role.W13_INPUT_SCALE: a13_v,
                Role.W2_INPUT_SCALE: a2_v, Role.G1_ALPHAS: g1, Role.G2_ALPHAS: g2,
                Role.A1_GSCALE: torch.reciprocal(a13_v), Role.A2_GSCALE: torch.reciprocal(a2_v),
                Role.OUTPUT1_SCALE_SCALAR: g1 * torch.reciprocal(a2_v), Role.OUTPUT1_SCALE_GATE_SCALAR: g1,
                Role.OUTPUT2_SCALE_SCALAR: g2}
    for role, value in want.items():
        got = getattr(mod, str(role), None)
        if got is not None:
            problems.scalar(str(role), got, value)


def _moe_bytes(mod, local: int, ex, i_slice: tuple[int, int], fp4: bool, src: Source, rt: Runtime,
               problems: _Problems) -> None:
    """One expert's weights (and block scales) after the target's inverse row orders, exactly; on the
    device the module is on (the source's bytes go there, not the converted ones to the CPU)."""
    layout, (i0, i1) = rt.layout, i_slice
    i, h = i1 - i0, mod.hidden
    dev = mod.w13_weight.device

    def rows(m, role: str, a: int, b: int) -> torch.Tensor:
        return src.cpu(m.tensors[role].name)[a:b].to(dev)

    def cols(m, role: str, a: int, b: int) -> torch.Tensor:
        return src.cpu(m.tensors[role].name)[:, a:b].to(dev)

    w13 = layout.moe_rows_decode(mod.w13_weight[local], gated=True)
    w2 = layout.moe_rows_decode(mod.w2_weight[local], gated=False)
    name = f"expert {ex.index}"
    if fp4:
        s1, s3 = src.scalar(ex.gate, WEIGHT_SCALE_2), src.scalar(ex.up, WEIGHT_SCALE_2)
        big = torch.maximum(s1, s3)
        problems.expect_equal(f"w13_weight ({name})", w13, torch.cat([rows(ex.up, WEIGHT, i0, i1),
                                                                      rows(ex.gate, WEIGHT, i0, i1)]))
        bs13 = layout.moe_rows_decode(unswizzle(mod.w13_weight_scale[local], 2 * i, h // 16,
                                                f"{mod.name}.w13_weight_scale[{local}]"), gated=True)
        problems.expect_equal(f"w13_weight_scale ({name})", bs13, torch.cat([
            apply_table("rescale", rows(ex.up, WEIGHT_SCALE, i0, i1), s3, big),
            apply_table("rescale", rows(ex.gate, WEIGHT_SCALE, i0, i1), s1, big)]))
        problems.expect_equal(f"w2_weight ({name})", w2, cols(ex.down, WEIGHT, i0 // 2, i1 // 2))
        bs2 = layout.moe_rows_decode(unswizzle(mod.w2_weight_scale[local], h, i // 16,
                                               f"{mod.name}.w2_weight_scale[{local}]"), gated=False)
        problems.expect_equal(f"w2_weight_scale ({name})", bs2, cols(ex.down, WEIGHT_SCALE, i0 // 16, i1 // 16))
    else:
        s1, s3 = src.scalar(ex.gate, WEIGHT_SCALE), src.scalar(ex.up, WEIGHT_SCALE)
        big = torch.maximum(s1, s3)
        problems.expect_equal(f"w13_weight ({name})", w13, torch.cat([
            apply_table("requant", rows(ex.up, WEIGHT, i0, i1), s3, big),
            apply_table("requant", rows(ex.gate, WEIGHT, i0, i1), s1, big)]))
        problems.expect_equal(f"w2_weight ({name})", w2, cols(ex.down, WEIGHT, i0, i1))


def _sample(n: int, rt: Runtime, opts, name: str) -> list[int]:
    """Experts that get GEMMs: all on CUDA; on the CPU the first and seeded others."""
    if rt.cuda or n <= CPU_SAMPLE_EXPERTS:
        return list(range(n))
    rest = torch.randperm(n - 1, generator=gen(opts.seed, name + "/experts"))[: CPU_SAMPLE_EXPERTS - 1] + 1
    return sorted({0, *rest.tolist()})


def _moe_stages(mod, experts, off: int, i_slice, fp4: bool, x, ref_in, source, src: Source, rt: Runtime, opts):
    """GEMM1 against the source; GEMM2 on the kernel's own intermediate. Returns kernel, emulated,
    stage errors, (error, threshold) of the worst stage relative to its threshold, per-expert outputs."""
    layout, (i0, i1), h = rt.layout, i_slice, mod.hidden
    i = i1 - i0
    sample = _sample(mod.experts, rt, opts, mod.name)
    stages = {"gemm1": 0.0, "gemm2": 0.0, "experts_numeric": len(sample)}
    worst = (-1.0, math.nan, 1.0)
    outs: dict[int, tuple] = {}
    if not fp4 and rt.cuda:
        grouped = _fp8_grouped(mod, sample, x, rt)
    for n, local in enumerate(sample):
        gid = off + local
        w1, w3, w2 = source(gid)
        ref1 = ref_in @ torch.cat([w3[i0:i1], w1[i0:i1]]).T  # [up | gate] (SEMANTICS §4)
        if fp4:
            w13 = layout.moe_rows_decode(mod.w13_weight[local], gated=True)
            bs13 = layout.moe_rows_decode(unswizzle(mod.w13_weight_scale[local], 2 * i, h // 16, "w13"), gated=True)
            w2l = layout.moe_rows_decode(mod.w2_weight[local], gated=False)
            bs2 = layout.moe_rows_decode(unswizzle(mod.w2_weight_scale[local], h, i // 16, "w2"), gated=False)
            b13 = _scaled_e2m1(w13.to(rt.device), bs13.to(rt.device))
            b2 = _scaled_e2m1(w2l.to(rt.device), bs2.to(rt.device))
            o1 = _gemm(nvfp4_quant(x, mod.a1_gscale[local]), b13, rt) * mod.g1_alphas[local].float()
            act = F.silu(o1[:, i:]) * o1[:, :i]  # FlashInfer: act(second half) * first half
            ha = nvfp4_quant(act, mod.a2_gscale[local])
            o2 = _gemm(ha, b2, rt) * mod.g2_alphas[local].float()
            h_true = ha / mod.a2_gscale[local].float()
            kernel, emulated = "emulated NVFP4 MoE (decoded layout, exact products)", True
            ex = experts[local]
            rescaled = float(src.scalar(ex.gate, WEIGHT_SCALE_2)) != float(src.scalar(ex.up, WEIGHT_SCALE_2))
            t1 = THRESHOLDS["nvfp4_moe_gemm1_rescaled" if rescaled else "nvfp4_moe_gemm1"]
            t2 = THRESHOLDS["nvfp4_moe_gemm2"]
        else:
            if rt.cuda:
                o1, o2, hq = (part[n] for part in grouped)
                kernel, emulated = "torch._scaled_grouped_mm", False
            else:
                o1, o2, hq = _fp8_expert(mod, local, x, rt)
                kernel, emulated = "torch._scaled_mm per expert (CPU)", False
            h_true = hq.float() * mod.w2_input_scale.float()
            t1, t2 = THRESHOLDS["fp8_moe_gemm1"], THRESHOLDS["fp8_moe_gemm2"]
        ref2 = h_true @ w2[:, i0:i1].T
        e1, e2 = rel_error(o1, ref1), rel_error(o2, ref2)
        for stage, err, thr in (("gemm1", e1, t1), ("gemm2", e2, t2)):
            stages[stage] = math.nan if math.isnan(err) or math.isnan(stages[stage]) else max(stages[stage], err)
            ratio = math.inf if math.isnan(err) else err / thr
            if ratio > worst[0]:
                worst = (ratio, err, thr)
        outs[gid] = (o1, o2, h_true)
    return kernel, emulated, stages, (worst[1], worst[2]), outs


def _moe_cross(name: str, per_rank: dict, x, ref_in, source, inter: int, fp4: bool) -> CrossResult:
    """Tensor-parallel MoE: rank GEMM1 outputs concatenate to the full expert's, GEMM2 outputs sum to
    the full down projection of the concatenated intermediate (SEMANTICS §10)."""
    worst = 0.0
    common = set.intersection(*(set(outs) for _, outs in per_rank.values()))
    for gid in sorted(common):
        w1, w3, w2 = source(gid)
        full1 = ref_in @ torch.cat([w3, w1]).T
        got1 = torch.empty_like(full1)
        h_parts, total2 = [], 0
        for rank in sorted(per_rank):
            (i0, i1), outs = per_rank[rank]
            o1, o2, h_true = outs[gid]
            i = i1 - i0
            got1[:, i0:i1], got1[:, inter + i0:inter + i1] = o1[:, :i], o1[:, i:]
            h_parts.append(h_true)
            total2 = total2 + o2
        ref2 = torch.cat(h_parts, dim=1) @ w2.T
        worst = max(worst, rel_error(got1, full1) / THRESHOLDS["nvfp4_moe_gemm1_rescaled" if fp4 else "fp8_moe_gemm1"],
                    rel_error(total2, ref2) / THRESHOLDS["nvfp4_moe_gemm2" if fp4 else "fp8_moe_gemm2"])
    passed = worst <= 1.0
    return CrossResult(name, "tensor-parallel experts: GEMM1 concatenates, GEMM2 sums over ranks", worst, 1.0, passed,
                       "" if passed else f"error {worst:.3g}x the threshold")


def _fp8_expert(mod, local: int, x: torch.Tensor, rt: Runtime):
    layout, i = rt.layout, mod.intermediate
    w13 = layout.moe_rows_decode(mod.w13_weight[local], gated=True)
    w2 = layout.moe_rows_decode(mod.w2_weight[local], gated=False)
    xq = (x.float() * mod.w13_input_scale_inv.float()).clamp(-448, 448).to(FP8)
    one = torch.tensor(1.0, device=rt.device)
    o1 = scaled_mm(xq, w13, one, mod.g1_alphas[local].float())
    act = F.silu(o1[:, i:]) * o1[:, :i]
    hq = (act * mod.w2_input_scale_inv.float()).clamp(-448, 448).to(FP8)
    o2 = scaled_mm(hq, w2, one, mod.g2_alphas[local].float())
    return o1, o2, hq


def _fp8_grouped(mod, sample: list[int], x: torch.Tensor, rt: Runtime):
    """All sampled experts in two torch._scaled_grouped_mm calls (SEMANTICS §9), the same tokens each."""
    layout, i, h, t = rt.layout, mod.intermediate, mod.hidden, x.shape[0]
    e = len(sample)
    w13 = torch.stack([layout.moe_rows_decode(mod.w13_weight[s], gated=True) for s in sample])
    w2 = torch.stack([layout.moe_rows_decode(mod.w2_weight[s], gated=False) for s in sample])
    xq = (x.float() * mod.w13_input_scale_inv.float()).clamp(-448, 448).to(FP8).repeat(e, 1)
    offs = torch.arange(1, e + 1, device=rt.device, dtype=torch.int32) * t
    ones = torch.ones(xq.shape[0], device=rt.device)
    g1 = mod.g1_alphas[sample].float()
    g2 = mod.g2_alphas[sample].float()
    o1 = torch._scaled_grouped_mm(xq, w13.transpose(-2, -1), ones, g1[:, None].expand(e, 2 * i).contiguous(),
                                  offs=offs, out_dtype=torch.bfloat16).float()
    act = F.silu(o1[:, i:]) * o1[:, :i]
    hq = (act * mod.w2_input_scale_inv.float()).clamp(-448, 448).to(FP8)
    o2 = torch._scaled_grouped_mm(hq, w2.transpose(-2, -1), ones, g2[:, None].expand(e, h).contiguous(),
                                  offs=offs, out_dtype=torch.bfloat16).float()
    return list(o1.split(t)), list(o2.split(t)), list(hq.split(t))


def _moe_fused(mod, experts, x, ref_in, a2d, fp4, src: Source, rt: Runtime, opts):
    """FlashInfer's fused kernel gives only the layer output: one end-to-end check with routing."""
    t = x.shape[0]
    g = gen(opts.seed, mod.name + "/routing")
    top_k = min(2, mod.experts)
    ids = torch.stack([torch.randperm(mod.experts, generator=g)[:top_k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, top_k, generator=g), dim=-1)
    ids, w = ids.to(rt.device), w.to(rt.device)
    run = flashinfer_args.run_cutlass_fused_moe_nvfp4 if fp4 else flashinfer_args.run_cutlass_fused_moe_fp8
    out = run(rt.fi, mod, x, ids, w)
    ref = torch.zeros(t, mod.hidden, device=rt.device)
    for e in range(mod.experts):
        sel = (ids == e).nonzero()
        if not len(sel):
            continue
        ex = experts[e]
        tok = sel[:, 0]
        xt = ref_in[tok]
        hmid = F.silu(xt @ src.dequant(ex.gate).T) * (xt @ src.dequant(ex.up).T)
        hq = (nvfp4_quant(hmid, 1 / a2d) * a2d) if fp4 else fp8_static(hmid, a2d).float() * a2d
        ref.index_add_(0, tok, (hq @ src.dequant(ex.down).T) * w[tok, sel[:, 1], None])
    err = rel_error(out, ref)
    return "flashinfer.cutlass_fused_moe", False, {"fused": err}, (err, THRESHOLDS["fused_moe"])


# --- results -----------------------------------------------------------------------------------------------

def _finish(res: ModuleResult, problems: list[str], t0: float) -> ModuleResult:
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
