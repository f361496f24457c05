"""Fused MoE layers of one converted output, per rank: every expert's bytes, every scale vector,
stage-wise numerics on sampled experts, and the tensor-parallel cross-rank property (the checks
``mocli.plan.moe`` answers to). What differs between FP8 and NVFP4 experts is one class per kind,
in ``MOE``.

MoE is checked stage by stage: GEMM1 (x @ [w3; w1]) against the source, GEMM2 fed with the kernel's
own quantized intermediate, so saturation of the intermediate format (a property of the scales, not
of the layout) cannot read as a fault.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from mocli.errors import CorruptFileError
from mocli.kinds import ModuleKind, Role
from mocli.loader import ConvertedCheckpoint
from mocli.numerics import FP8_MAX
from mocli.numerics.in_torch import FP8, fp8_static
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE
from mocli.targets.decode import LayoutError
from mocli.verify import flashinfer_args
from mocli.verify.common import (
    FUSED_MOE_THRESHOLD,
    THRESHOLDS,
    CrossResult,
    Halves,
    Kernels,
    ModuleResult,
    Problems,
    Runtime,
    Source,
    gen,
    rel_error,
    sample_experts,
    scaled_mm,
)
from mocli.verify.cross import moe_cross
from mocli.verify.expect import apply_table, bit_equal, to_numpy
from mocli.verify.results import Stages, rank_check, take_bytes


class _Experts:
    """One MoE kind: its scales, its activation format, its bytes and its kernel for one expert."""

    kind: ModuleKind
    scale: str  # the per-expert weight scale merged over w1/w3
    act_max: float  # largest activation the input scale covers, in units of a13

    def __init__(self, layer, src: Source, rt: Runtime) -> None:
        self.layer, self.src, self.rt = layer, src, rt
        self.limits = THRESHOLDS[self.kind]

    def quant_input(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Activations as the kernel quantizes them with the per-tensor input scale ``a``, dequantized."""
        raise NotImplementedError

    def consistency(self, mod, experts, a13, a2, problems: Problems) -> None:
        """Every scale vector of the layer against SEMANTICS §4/§7 over the source's scales."""
        s1, s3, s2 = (torch.stack([self.src.scalar(getattr(ex, p), self.scale) for ex in experts])
                      for p in ("gate", "up", "down"))
        w13 = torch.maximum(s1, s3)
        for role, value in self.expected_scales(w13, s2, a13, a2, len(experts)).items():
            got = getattr(mod, str(role), None)
            if got is not None:
                problems.scalar(str(role), got, value)

    def expected_scales(self, w13, s2, a13, a2, e: int) -> dict[Role, torch.Tensor]:
        raise NotImplementedError

    def decoded(self, mod, which: int | slice, i_slice: tuple[int, int],
                halves: bool = False) -> dict[str, Callable[[], torch.Tensor | Halves]]:
        """The stored bytes of local expert ``which`` (an index; a slice: those experts stacked) after the
        target's inverse transforms, by role in the order they are checked; each decoded when called.
        ``halves`` (one expert): row orders undone as views where they can be (``Halves``), to compare."""
        raise NotImplementedError

    def rows_decode(self, halves: bool) -> Callable[[torch.Tensor, bool], torch.Tensor | Halves]:
        layout = self.rt.layout
        if not halves:
            return layout.moe_rows_decode

        def rows(stored: torch.Tensor, gated: bool) -> torch.Tensor | Halves:
            v = layout.moe_rows_halves(stored, gated)
            return layout.moe_rows_decode(stored, gated) if v is None else Halves(v)
        return rows

    def expected(self, ex, i_slice: tuple[int, int], dev) -> dict[str, list[torch.Tensor]]:
        """What ``decoded`` must hold for source expert ``ex``, by role: parts laid end to end on dim 0,
        on the device the module is on (the source's bytes go there, not the converted ones to the CPU)."""
        raise NotImplementedError

    def expert_bytes(self, mod, local: int, ex, i_slice: tuple[int, int], problems: Problems) -> None:
        """One expert's weights (and block scales), exactly."""
        got = self.decoded(mod, local, i_slice, halves=True)
        for role, parts in self.expected(ex, i_slice, mod.w13_weight.device).items():
            what = f"{role} (expert {ex.index})"
            if len(parts) == 1:
                problems.expect_equal(what, got[role](), parts[0])
            else:
                problems.expect_parts(what, got[role](), parts)

    def all_bytes(self, mod, experts, i_slice: tuple[int, int]) -> bool:
        """Every expert's bytes, stacked a chunk of experts at a time (the comparisons of ``expert_bytes``
        in a few calls instead of a few per expert): True when all match. False also for a layout fault
        or a device out of memory: the caller then goes expert by expert, which names the expert and
        holds one at a time."""
        per = max(1, STACKED_BYTES // max(1, sum(t[0].nbytes for t in (mod.w13_weight, mod.w2_weight))))
        try:
            return all(self._stacked_bytes(mod, experts[a:a + per], a, i_slice) for a in range(0, len(experts), per))
        except (LayoutError, torch.OutOfMemoryError):
            return False

    def _stacked_bytes(self, mod, experts, first: int, i_slice: tuple[int, int]) -> bool:
        got = self.decoded(mod, slice(first, first + len(experts)), i_slice)
        wants = [self.expected(ex, i_slice, mod.w13_weight.device) for ex in experts]
        return all(bit_equal(got[role](), torch.stack([torch.cat(w[role]) if len(w[role]) > 1 else w[role][0]
                                                       for w in wants]))
                   for role in got)

    def rows(self, m, role: str, a: int, b: int, dev) -> torch.Tensor:
        return self.src.near(m.tensors[role].name)[a:b].to(dev)

    def cols(self, m, role: str, a: int, b: int, dev) -> torch.Tensor:
        return self.src.near(m.tensors[role].name)[:, a:b].to(dev)

    @property
    def grouped(self) -> bool:
        """Whether one call runs every expert's GEMMs (then every expert gets them; ``sample_experts``)."""
        return False

    def prepare(self, mod, sample: list[int], x: torch.Tensor):
        """Work shared by the sampled experts of one rank (FP8 on CUDA: one grouped GEMM)."""
        return None

    def expert_gemms(self, mod, n: int, local: int, i: int, x: torch.Tensor, shared):
        """(GEMM1 out, GEMM2 out, the kernel's intermediate dequantized, kernel, emulated, GEMM1 threshold)."""
        raise NotImplementedError

    def fused(self, mod, x, ids, w) -> torch.Tensor:
        raise NotImplementedError


class _Fp8Experts(_Experts):
    kind, scale, act_max = ModuleKind.FP8_MOE, WEIGHT_SCALE, FP8_MAX

    def quant_input(self, x, a):
        return fp8_static(x, a).float() * a

    def expected_scales(self, w13, s2, a13, a2, e):
        g1, g2 = w13 * a13, s2 * a2
        return {Role.W13_WEIGHT_SCALE: w13, Role.W2_WEIGHT_SCALE: s2, Role.W13_INPUT_SCALE: a13,
                Role.W2_INPUT_SCALE: a2, Role.W13_INPUT_SCALE_INV: torch.reciprocal(a13),
                Role.W2_INPUT_SCALE_INV: torch.reciprocal(a2), Role.G1_ALPHAS: g1, Role.G2_ALPHAS: g2,
                Role.OUTPUT1_SCALES_SCALAR: g1 * torch.reciprocal(a2), Role.OUTPUT1_SCALES_GATE_SCALAR: g1,
                Role.OUTPUT2_SCALES_SCALAR: g2}

    def decoded(self, mod, which, i_slice, halves=False):
        rows = self.rows_decode(halves)
        return {"w13_weight": lambda: rows(mod.w13_weight[which], True),
                "w2_weight": lambda: rows(mod.w2_weight[which], False)}

    def expected(self, ex, i_slice, dev):
        (i0, i1) = i_slice
        s1, s3 = self.src.scalar(ex.gate, WEIGHT_SCALE), self.src.scalar(ex.up, WEIGHT_SCALE)
        big = torch.maximum(s1, s3)
        return {"w13_weight": [apply_table("requant", self.rows(ex.up, WEIGHT, i0, i1, dev), s3, big),
                               apply_table("requant", self.rows(ex.gate, WEIGHT, i0, i1, dev), s1, big)],
                "w2_weight": [self.cols(ex.down, WEIGHT, i0, i1, dev)]}

    @property
    def grouped(self) -> bool:
        return self.rt.cuda

    def prepare(self, mod, sample, x):
        return _fp8_grouped(mod, sample, x, self.rt) if self.rt.cuda else None

    def expert_gemms(self, mod, n, local, i, x, grouped):
        if grouped is not None:
            o1, o2, hq = (part[n] for part in grouped)
            kernel = "torch._scaled_grouped_mm"
        else:
            o1, o2, hq = _fp8_expert(mod, local, x, self.rt)
            kernel = "torch._scaled_mm per expert (CPU)"
        return o1, o2, hq.float() * mod.w2_input_scale.float(), kernel, False, self.limits.kept

    def fused(self, mod, x, ids, w):
        return flashinfer_args.run_cutlass_fused_moe_fp8(mod, x, ids, w)


# Devices where a layer's expert bytes are compared stacked (``_Experts.all_bytes``), and how many
# output bytes at a time (the source's and the decoded copies come to about three times that). On the
# CPU the copies would cost memory and passes the expert-by-expert path never makes.
STACKED_BYTES_ON = ("cuda",)
STACKED_BYTES = 512 << 20

MOE: dict[ModuleKind, type[_Experts]] = {ModuleKind.FP8_MOE: _Fp8Experts}


def check_moe(name: str, infos: dict[int, dict], cks: dict[int, ConvertedCheckpoint], src: Source, rt: Runtime,
              opts) -> tuple[list[ModuleResult], CrossResult | None]:
    """One MoE layer on every given rank: bytes of every expert, consistency, stage-wise numerics on a
    sample of experts; then (tensor parallel, all ranks) the concatenation / sum over ranks."""
    kind = ModuleKind(next(iter(infos.values()))["kind"])
    layer = src.layers[name]
    case = MOE[kind](layer, src, rt)
    every = [layer.experts[e] for e in sorted(layer.experts)]
    a13 = torch.stack([torch.maximum(src.scalar(e.gate, INPUT_SCALE), src.scalar(e.up, INPUT_SCALE)) for e in every]).max()
    a2 = torch.stack([src.scalar(e.down, INPUT_SCALE) for e in every]).max()
    x = (torch.randn(opts.tokens, layer.hidden, generator=gen(opts.seed, name)) * (float(a13) * case.act_max / 4)
         ).to(rt.device)
    ref_in = case.quant_input(x, a13.to(rt.device))
    weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def source(gid: int):  # dequantized w1, w3, w2 of a global expert, once per module
        if gid not in weights:
            ex = layer.experts[gid]
            weights[gid] = (src.dequant(ex.gate), src.dequant(ex.up), src.dequant(ex.down))
        return weights[gid]

    results, per_rank = [], {}
    with src.on_device(_expert_tensors(layer, infos)):
        for rank, info in infos.items():
            meta = info["meta"]
            with rank_check(results, name, rank, info, kind, 0.0) as (res, problems):
                mod = cks[rank].load_module(name, rt.device)
                off = meta.get("expert_offset", 0)
                i_slice = tuple(meta.get("intermediate_slice", [0, meta["intermediate"]]))
                experts = [layer.experts[off + e] for e in range(mod.experts)]
                case.consistency(mod, experts, a13, a2, problems)
                # the bytes beside the GEMMs on the CPU: each leaves cores idle that the other can use
                found = _BYTES.submit(_all_expert_bytes, case, mod, experts, i_slice) \
                    if rt.device.type == "cpu" and (os.cpu_count() or 1) > 1 else _done(_all_expert_bytes(
                        case, mod, experts, i_slice))
                try:
                    if rt.fi is not None and rt.kernels is Kernels.FLASHINFER:
                        numbers = (*_fused(case, mod, experts, x, ref_in, a2.to(rt.device), opts), None)
                    else:
                        numbers = _stages(case, mod, off, i_slice, x, ref_in, source, opts)
                finally:
                    take_bytes(found, problems)
                res.kernel, res.emulated, res.stages, (res.error, res.threshold), outs = numbers
                if outs is not None:
                    per_rank[rank] = (i_slice, outs)
    cross = None
    if len({i_slice for i_slice, _ in per_rank.values()}) > 1 and len(per_rank) == len(infos):
        np_rank = {r: (sl, {g: tuple(map(to_numpy, v)) for g, v in outs.items()}) for r, (sl, outs) in per_rank.items()}
        ref_np = to_numpy(ref_in)

        def reference(gid: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            w1, w3, w2 = map(to_numpy, source(gid))
            return ref_np @ np.concatenate([w3, w1]).T, h @ w2.T

        cross = moe_cross(name, np_rank, reference, layer.intermediate, case.limits)
    return results, cross


# One thread for the expert byte checks of the CPU path (torch drops the GIL in its operations).
_BYTES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mocli-verify-bytes")


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _all_expert_bytes(case: _Experts, mod, experts, i_slice: tuple[int, int]) -> tuple[Problems, Exception | None]:
    """Every expert's bytes of one rank: the differences in expert order, and the layout fault that
    stopped the check, if one did (the differences found before it are kept). The whole layer in a
    few calls where that runs (about 2 ms an expert one by one on a GPU, a second for a 6-layer,
    64-expert model); expert by expert where it finds a difference, to name the expert."""
    found = Problems()
    try:
        if not (case.rt.device.type in STACKED_BYTES_ON and case.all_bytes(mod, experts, i_slice)):
            for local, ex in enumerate(experts):
                case.expert_bytes(mod, local, ex, i_slice, found)
    except (LayoutError, CorruptFileError) as e:
        return found, e
    return found, None


def _expert_tensors(layer, infos: dict[int, dict]) -> list[str]:
    """Weights and block scales of the source experts the checked ranks hold (none if a manifest's meta
    is malformed: the checks below report that)."""
    try:
        gids = {int(i["meta"].get("expert_offset", 0)) + e for i in infos.values() for e in range(int(i["meta"]["experts"]))}
    except (KeyError, TypeError, ValueError):
        return []
    return [m.tensors[role].name for g in sorted(gids & set(layer.experts)) for m in (layer.experts[g].gate,
            layer.experts[g].up, layer.experts[g].down) for role in (WEIGHT, WEIGHT_SCALE) if role in m.tensors]


def _stages(case: _Experts, mod, off: int, i_slice, x, ref_in, source, opts):
    """GEMM1 against the source; GEMM2 on the kernel's own intermediate. Returns kernel, emulated,
    stage errors, (error, threshold) of the worst stage relative to its threshold, per-expert outputs."""
    (i0, i1), rt = i_slice, case.rt
    i = i1 - i0
    sample = sample_experts(mod.experts, rt, opts, mod.name, every=case.grouped)
    stages = Stages(len(sample))
    outs: dict[int, tuple] = {}
    kernel, emulated = "", False
    shared = case.prepare(mod, sample, x)
    for n, local in enumerate(sample):
        gid = off + local
        w1, w3, w2 = source(gid)
        ref1 = torch.cat([ref_in @ w3[i0:i1].T, ref_in @ w1[i0:i1].T], dim=1)  # [up | gate] (SEMANTICS §4)
        o1, o2, h_true, kernel, emulated, t1 = case.expert_gemms(mod, n, local, i, x, shared)
        ref2 = h_true @ w2[:, i0:i1].T
        stages.add("gemm1", rel_error(o1, ref1), t1)
        stages.add("gemm2", rel_error(o2, ref2), case.limits.gemm2)
        outs[gid] = (o1, o2, h_true)
    return kernel, emulated, stages.errors, stages.result(), outs


def _fp8_expert(mod, local: int, x: torch.Tensor, rt: Runtime):
    layout, i = rt.layout, mod.intermediate
    w13 = layout.moe_rows_decode(mod.w13_weight[local], gated=True)
    w2 = layout.moe_rows_decode(mod.w2_weight[local], gated=False)
    xq = (x.float() * mod.w13_input_scale_inv.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    one = torch.tensor(1.0, device=rt.device)
    o1 = scaled_mm(xq, w13, one, mod.g1_alphas[local].float())
    act = F.silu(o1[:, i:]) * o1[:, :i]
    hq = (act * mod.w2_input_scale_inv.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    o2 = scaled_mm(hq, w2, one, mod.g2_alphas[local].float())
    return o1, o2, hq


def _fp8_grouped(mod, sample: list[int], x: torch.Tensor, rt: Runtime):
    """All sampled experts in two torch._scaled_grouped_mm calls (SEMANTICS §9), the same tokens each."""
    layout, i, h, t = rt.layout, mod.intermediate, mod.hidden, x.shape[0]
    e = len(sample)
    w13 = torch.stack([layout.moe_rows_decode(mod.w13_weight[s], gated=True) for s in sample])
    w2 = torch.stack([layout.moe_rows_decode(mod.w2_weight[s], gated=False) for s in sample])
    xq = (x.float() * mod.w13_input_scale_inv.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8).repeat(e, 1)
    offs = torch.arange(1, e + 1, device=rt.device, dtype=torch.int32) * t
    ones = torch.ones(xq.shape[0], device=rt.device)
    g1 = mod.g1_alphas[sample].float()
    g2 = mod.g2_alphas[sample].float()
    o1 = torch._scaled_grouped_mm(xq, w13.transpose(-2, -1), ones, g1[:, None].expand(e, 2 * i).contiguous(),
                                  offs=offs, out_dtype=torch.bfloat16).float()
    act = F.silu(o1[:, i:]) * o1[:, :i]
    hq = (act * mod.w2_input_scale_inv.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    o2 = torch._scaled_grouped_mm(hq, w2.transpose(-2, -1), ones, g2[:, None].expand(e, h).contiguous(),
                                  offs=offs, out_dtype=torch.bfloat16).float()
    return list(o1.split(t)), list(o2.split(t)), list(hq.split(t))


def _fused(case: _Experts, mod, experts, x, ref_in, a2d, opts):
    """FlashInfer's fused kernel gives only the layer output: one end-to-end check with routing."""
    rt, src, t = case.rt, case.src, x.shape[0]
    g = gen(opts.seed, mod.name + "/routing")
    top_k = min(2, mod.experts)
    ids = torch.stack([torch.randperm(mod.experts, generator=g)[:top_k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, top_k, generator=g), dim=-1)
    ids, w = ids.to(rt.device), w.to(rt.device)
    out = case.fused(mod, x, ids, w)
    ref = torch.zeros(t, mod.hidden, device=rt.device)
    for e in range(mod.experts):
        sel = (ids == e).nonzero()
        if not len(sel):
            continue
        ex = experts[e]
        tok = sel[:, 0]
        xt = ref_in[tok]
        hmid = F.silu(xt @ src.dequant(ex.gate).T) * (xt @ src.dequant(ex.up).T)
        ref.index_add_(0, tok, (case.quant_input(hmid, a2d) @ src.dequant(ex.down).T) * w[tok, sel[:, 1], None])
    err = rel_error(out, ref)
    return "flashinfer.cutlass_fused_moe", False, {"fused": err}, (err, FUSED_MOE_THRESHOLD)
