"""``fp8_moe`` (SEMANTICS §4), in torch: every expert's weight bytes (w1/w3 requantized to their shared
scale by verify's own tables) after the target's inverse transforms, every scale vector, and stage-wise
GEMMs: ``torch._scaled_grouped_mm`` over every expert on CUDA, ``torch._scaled_mm`` per sampled expert
on the CPU; FlashInfer's fused kernel when asked for (``--kernels flashinfer``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from mocli.errors import CorruptFileError
from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind, Role
from mocli.numerics import FP8_MAX
from mocli.numerics.in_torch import FP8, fp8_static
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE
from mocli.targets.decode import LayoutError
from mocli.verify import flashinfer_args
from mocli.verify.common import Kernels, gen, sample_experts, scaled_mm
from mocli.verify.expect import apply_table, bit_equal, src_requant, to_numpy
from mocli.verify.kinds import byte_checks
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.moe import MoeCase, check_moe, done
from mocli.verify.results import FUSED_MOE_THRESHOLD, Halves, Problems, Stages, rel_error

# Devices where a layer's expert bytes are compared stacked (``Fp8Moe.stacked_bytes``), and how many
# output bytes at a time (the source's and the decoded copies come to about three times that). On the
# CPU the copies would cost memory and passes the expert-by-expert path never makes.
STACKED_BYTES_ON = ("cuda",)
STACKED_BYTES = 512 << 20
# One thread for the expert byte checks of the CPU path (torch drops the GIL in its operations):
# ``byte_checks(..., 1)`` below.


class Fp8Moe(MoeCase):
    kind = ModuleKind.FP8_MOE

    def __init__(self, name: str, ctx: CheckContext) -> None:
        super().__init__(name, ctx)
        src, rt, layer = self.src, ctx.rt, self.layer
        self.rt = rt
        every = [layer.experts[e] for e in sorted(layer.experts)]
        self.a13 = torch.stack([torch.maximum(src.scalar_t(e.gate, INPUT_SCALE), src.scalar_t(e.up, INPUT_SCALE))
                                for e in every]).max()
        self.a2 = torch.stack([src.scalar_t(e.down, INPUT_SCALE) for e in every]).max()
        self.x = (torch.randn(ctx.opts.tokens, layer.hidden, generator=gen(ctx.opts.seed, name))
                  * (float(self.a13) * FP8_MAX / 4)).to(rt.device)
        self.ref_in = self.quant_input(self.x, self.a13.to(rt.device))
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def source(self, gid: int):
        """Dequantized w1, w3, w2 of a global expert, once per module."""
        if gid not in self.weights:
            ex = self.layer.experts[gid]
            self.weights[gid] = (self.src.fp8_dequant(ex.gate), self.src.fp8_dequant(ex.up), self.src.fp8_dequant(ex.down))
        return self.weights[gid]

    @staticmethod
    def quant_input(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Activations as the kernel quantizes them with the per-tensor input scale ``a``, dequantized."""
        return fp8_static(x, a).float() * a

    def context(self, infos):
        return self.src.on_device(_expert_tensors(self.layer, infos))

    def load(self, ck):
        return ck.load_module(self.name, self.rt.device)

    def consistency(self, mod, experts, problems: Problems) -> None:
        """Every scale vector of the layer against SEMANTICS §4 over the source's scales."""
        s1, s3, s2 = (torch.stack([self.src.scalar_t(getattr(ex, p), WEIGHT_SCALE) for ex in experts])
                      for p in ("gate", "up", "down"))
        w13 = torch.maximum(s1, s3)
        a13, a2 = self.a13, self.a2
        g1, g2 = w13 * a13, s2 * a2
        want = {Role.W13_WEIGHT_SCALE: w13, Role.W2_WEIGHT_SCALE: s2, Role.W13_INPUT_SCALE: a13,
                Role.W2_INPUT_SCALE: a2, Role.W13_INPUT_SCALE_INV: torch.reciprocal(a13),
                Role.W2_INPUT_SCALE_INV: torch.reciprocal(a2), Role.G1_ALPHAS: g1, Role.G2_ALPHAS: g2,
                Role.OUTPUT1_SCALES_SCALAR: g1 * torch.reciprocal(a2), Role.OUTPUT1_SCALES_GATE_SCALAR: g1,
                Role.OUTPUT2_SCALES_SCALAR: g2}
        for role, value in want.items():
            got = getattr(mod, str(role), None)
            if got is not None:
                problems.scalar(str(role), got, value)

    # --- bytes -------------------------------------------------------------------------------------

    def decoded(self, mod, which: int | slice, halves: bool = False) -> dict[str, Callable]:
        """The stored bytes of local expert ``which`` (an index; a slice: those experts stacked) after the
        target's inverse transforms, by role; each decoded when called. ``halves`` (one expert): row
        orders undone as views where they can be (``Halves``), to compare."""
        layout = self.ctx.layout

        def rows(stored: torch.Tensor, gated: bool):
            if not halves:
                return layout.moe_rows_decode(stored, gated)
            v = layout.moe_rows_halves(stored, gated)
            return layout.moe_rows_decode(stored, gated) if v is None else Halves(v)

        return {"w13_weight": lambda: rows(mod.w13_weight[which], True),
                "w2_weight": lambda: rows(mod.w2_weight[which], False)}

    def expected(self, ex, i_slice: tuple[int, int], dev) -> dict[str, list[torch.Tensor]]:
        """What ``decoded`` must hold for source expert ``ex``, by role: parts laid end to end on dim 0,
        on the device the module is on (the source's bytes go there, not the converted ones to the CPU)."""
        (i0, i1), src = i_slice, self.src
        s1, s3 = src.scalar_t(ex.gate, WEIGHT_SCALE), src.scalar_t(ex.up, WEIGHT_SCALE)
        big = torch.maximum(s1, s3)
        near = lambda m: src.near(m.tensors[WEIGHT].name)  # noqa: E731
        return {"w13_weight": [apply_table(src_requant(src), near(ex.up)[i0:i1].to(dev), s3, big),
                               apply_table(src_requant(src), near(ex.gate)[i0:i1].to(dev), s1, big)],
                "w2_weight": [near(ex.down)[:, i0:i1].to(dev)]}

    def all_bytes(self, mod, experts, i_slice):
        # on the CPU beside the GEMMs: each leaves cores idle that the other can use
        if self.rt.device.type == "cpu" and (os.cpu_count() or 1) > 1:
            return byte_checks("mocli-verify-fp8-bytes", 1).submit(self._all_bytes, mod, experts, i_slice)
        return done(self._all_bytes(mod, experts, i_slice))

    def _all_bytes(self, mod, experts, i_slice) -> tuple[Problems, Exception | None]:
        """Every expert's bytes of one rank: the differences in expert order, and the layout fault that
        stopped the check, if one did. The whole layer in a few calls where that runs (about 2 ms an
        expert one by one on a GPU); expert by expert where it finds a difference, to name the expert."""
        found = Problems()
        try:
            if not (self.rt.device.type in STACKED_BYTES_ON and self.stacked_bytes(mod, experts, i_slice)):
                for local, ex in enumerate(experts):
                    self.expert_bytes(mod, local, ex, i_slice, found)
        except (LayoutError, CorruptFileError) as e:
            return found, e
        return found, None

    def expert_bytes(self, mod, local: int, ex, i_slice: tuple[int, int], problems: Problems) -> None:
        """One expert's weights, exactly."""
        got = self.decoded(mod, local, halves=True)
        for role, parts in self.expected(ex, i_slice, mod.w13_weight.device).items():
            what = f"{role} (expert {ex.index})"
            if len(parts) == 1:
                problems.expect_equal(what, got[role](), parts[0])
            else:
                problems.expect_parts(what, got[role](), parts)

    def stacked_bytes(self, mod, experts, i_slice) -> bool:
        """Every expert's bytes, a chunk of experts at a time: True when all match. False also for a
        layout fault or a device out of memory: the caller then goes expert by expert."""
        per = max(1, STACKED_BYTES // max(1, sum(t[0].nbytes for t in (mod.w13_weight, mod.w2_weight))))
        try:
            for a in range(0, len(experts), per):
                got = self.decoded(mod, slice(a, a + per))
                wants = [self.expected(ex, i_slice, mod.w13_weight.device) for ex in experts[a:a + per]]
                if not all(bit_equal(got[role](), torch.stack([torch.cat(w[role]) if len(w[role]) > 1 else w[role][0]
                                                               for w in wants])) for role in got):
                    return False
            return True
        except (LayoutError, torch.OutOfMemoryError):
            return False

    # --- numbers -----------------------------------------------------------------------------------

    def numbers(self, ck, mod, off, i_slice):
        if self.rt.fi is not None and self.rt.kernels is Kernels.FLASHINFER:
            return (*self.fused(mod, off), None)
        return self.stages(mod, off, i_slice)

    def stages(self, mod, off: int, i_slice):
        """GEMM1 against the source; GEMM2 on the kernel's own intermediate."""
        (i0, i1), rt = i_slice, self.rt
        grouped = rt.cuda  # one call covers every expert: then every expert gets its GEMMs
        sample = sample_experts(mod.experts, rt, self.ctx.opts, mod.name, every=grouped)
        stages = Stages(len(sample))
        outs: dict[int, tuple] = {}
        shared = _fp8_grouped(mod, sample, self.x, rt) if grouped else None
        kernel = "torch._scaled_grouped_mm" if grouped else "torch._scaled_mm per expert (CPU)"
        for n, local in enumerate(sample):
            gid = off + local
            w1, w3, w2 = self.source(gid)
            ref1 = torch.cat([self.ref_in @ w3[i0:i1].T, self.ref_in @ w1[i0:i1].T], dim=1)  # [up | gate] (§4)
            o1, o2, hq = (part[n] for part in shared) if shared is not None else _fp8_expert(mod, local, self.x, rt)
            h_true = hq.float() * mod.w2_input_scale.float()
            stages.add("gemm1", rel_error(o1, ref1), self.limits.kept)
            stages.add("gemm2", rel_error(o2, h_true @ w2[:, i0:i1].T), self.limits.gemm2)
            outs[gid] = (o1, o2, h_true)
        return kernel, False, stages.errors, stages.result(), outs

    def fused(self, mod, off: int):
        """FlashInfer's fused kernel gives only the layer output: one end-to-end check with routing."""
        rt, src, x, t = self.rt, self.src, self.x, self.x.shape[0]
        g = gen(self.ctx.opts.seed, mod.name + "/routing")
        top_k = min(2, mod.experts)
        ids = torch.stack([torch.randperm(mod.experts, generator=g)[:top_k] for _ in range(t)]).to(rt.device)
        w = torch.softmax(torch.randn(t, top_k, generator=g), dim=-1).to(rt.device)
        out = flashinfer_args.run_cutlass_fused_moe_fp8(mod, x, ids, w)
        ref = torch.zeros(t, mod.hidden, device=rt.device)
        for e in range(mod.experts):
            sel = (ids == e).nonzero()
            if not len(sel):
                continue
            ex, tok = self.layer.experts[off + e], sel[:, 0]
            xt = self.ref_in[tok]
            hmid = F.silu(xt @ src.fp8_dequant(ex.gate).T) * (xt @ src.fp8_dequant(ex.up).T)
            ref.index_add_(0, tok, (self.quant_input(hmid, self.a2.to(rt.device)) @ src.fp8_dequant(ex.down).T)
                           * w[tok, sel[:, 1], None])
        err = rel_error(out, ref)
        return "flashinfer.cutlass_fused_moe", False, {"fused": err}, (err, FUSED_MOE_THRESHOLD)

    def numpy_outs(self, outs):
        return {g: tuple(map(to_numpy, v)) for g, v in outs.items()}

    def reference(self, gid: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w1, w3, w2 = map(to_numpy, self.source(gid))
        return to_numpy(self.ref_in) @ np.concatenate([w3, w1]).T, h @ w2.T


def _expert_tensors(layer, infos: dict[int, ModuleEntry]) -> list[str]:
    """Weights and block scales of the source experts the checked ranks hold (none if a manifest's meta
    is malformed: the checks report that)."""
    try:
        gids = {int(i.meta.get("expert_offset", 0)) + e for i in infos.values() for e in range(int(i.meta["experts"]))}
    except (KeyError, TypeError, ValueError):
        return []
    return [m.tensors[role].name for g in sorted(gids & set(layer.experts)) for m in (layer.experts[g].gate,
            layer.experts[g].up, layer.experts[g].down) for role in (WEIGHT, WEIGHT_SCALE) if role in m.tensors]


def _fp8_expert(mod, local: int, x: torch.Tensor, rt):
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


def _fp8_grouped(mod, sample: list[int], x: torch.Tensor, rt):
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


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_moe(name, infos, ctx, Fp8Moe)
