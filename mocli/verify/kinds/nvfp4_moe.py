"""``nvfp4_moe`` (SEMANTICS §7), checked with numpy alone (as ``nvfp4_linear``): every expert's weight
and block-scale bytes after the target's inverse transforms, every scale vector, emulated stage-wise
GEMMs on sampled experts against the source; FlashInfer's fused kernel where it runs (sm_100+)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind, Role
from mocli.numerics import E2M1_MAX, FP8_MAX
from mocli.numerics.in_numpy import bf16_round, nvfp4_quant, scaled_matmul, silu
from mocli.tables import INPUT_SCALE, PRE_QUANT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets.decode import unswizzle
from mocli.verify.expect import apply_table
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.moe import MoeCase, check_moe
from mocli.verify.results import (
    CPU_SAMPLE_EXPERTS,
    FUSED_MOE_THRESHOLD,
    Halves,
    Problems,
    Stages,
    pick_experts,
    rel_error,
    rng,
)
from mocli.verify.source import floats

EMULATED_MOE = "emulated NVFP4 MoE (decoded layout, exact products)"
ONE = np.float32(1)


class Nvfp4Moe(MoeCase):
    """One NVFP4 MoE layer: source scales, activations, dequantized experts on demand (numpy)."""

    kind = ModuleKind.NVFP4_MOE
    label = EMULATED_MOE  # what the emulated stages report as their kernel

    def __init__(self, name: str, ctx: CheckContext) -> None:
        super().__init__(name, ctx)
        src, opts = self.src, ctx.opts
        self.layout, self.opts = ctx.layout, opts
        every = [self.layer.experts[e] for e in sorted(self.layer.experts)]
        self.a13 = np.max([np.maximum(src.scalar(e.gate, INPUT_SCALE), src.scalar(e.up, INPUT_SCALE)) for e in every])
        self.a2 = np.max([src.scalar(e.down, INPUT_SCALE) for e in every])
        self.x = rng(opts.seed, name).standard_normal((opts.tokens, self.layer.hidden), dtype=np.float32) \
            * np.float32(float(self.a13) * FP8_MAX * E2M1_MAX / 4)
        pqs = every[0].gate.tensors.get(PRE_QUANT_SCALE)  # NVFP4_AWQ: the experts' one vector (AWQ001), §15.3
        self.pqs = None if pqs is None else bf16_round(src.floats(pqs.name))
        self.ref_in = self.quant(self.scaled(self.x, self.pqs), self.a13)

    @staticmethod
    def scaled(x: np.ndarray, pqs: np.ndarray | None) -> np.ndarray:
        """The layer's input times its pre_quant_scale in BF16, as the serving kernel takes it (or as it is)."""
        return x if pqs is None else bf16_round(bf16_round(x) * pqs)

    def load(self, ck):
        return ck.module_arrays(self.name)

    def numbers(self, ck, mod, off, i_slice):
        fp4 = self.ctx.fp4
        return self.fused(fp4, ck, mod) if fp4 is not None else self.stages(mod, off, i_slice)

    @staticmethod
    def quant(x: np.ndarray, a) -> np.ndarray:
        """Activations as the kernel quantizes them with the per-tensor input scale ``a``, dequantized."""
        return nvfp4_quant(x, ONE / a) * a

    def gemm1_ref(self, gid: int, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The source expert's GEMM1 of the reference input, [up | gate] (``rows``: the intermediate
        slice of each), with W dequantized a block of rows at a time (``SourceTensors.nvfp4_matmul``)."""
        ex = self.layer.experts[gid]
        return np.concatenate([self.src.nvfp4_matmul(self.ref_in, ex.up, rows=rows),
                               self.src.nvfp4_matmul(self.ref_in, ex.gate, rows=rows)], axis=1)

    def reference(self, gid: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``moe_cross``'s full GEMM1 and GEMM2 (of ``h``) for a global expert."""
        return self.gemm1_ref(gid), self.src.nvfp4_matmul(h, self.layer.experts[gid].down)

    def consistency(self, mod, experts, problems: Problems) -> None:
        """Every scale vector of the layer against SEMANTICS §7 over the source's scales."""
        s1, s3, s2 = (np.array([self.src.scalar(getattr(ex, p), WEIGHT_SCALE_2) for ex in experts], dtype=np.float32)
                      for p in ("gate", "up", "down"))
        w13 = np.maximum(s1, s3)
        e = len(experts)
        g1, g2 = w13 * self.a13, s2 * self.a2
        a13_v, a2_v = np.full(e, self.a13, dtype=np.float32), np.full(e, self.a2, dtype=np.float32)
        want = {Role.W13_WEIGHT_SCALE_2: w13, Role.W2_WEIGHT_SCALE_2: s2, Role.W13_INPUT_SCALE: a13_v,
                Role.W2_INPUT_SCALE: a2_v, Role.G1_ALPHAS: g1, Role.G2_ALPHAS: g2,
                Role.A1_GSCALE: ONE / a13_v, Role.A2_GSCALE: ONE / a2_v,
                Role.OUTPUT1_SCALE_SCALAR: g1 * (ONE / a2_v), Role.OUTPUT1_SCALE_GATE_SCALAR: g1,
                Role.OUTPUT2_SCALE_SCALAR: g2}
        for role, value in want.items():
            got = getattr(mod, str(role), None)
            if got is not None:
                problems.scalar(str(role), got, value)
        if (self.pqs is None) != (mod.pre_quant_scale is None):
            problems.append("pre_quant_scale: the source's experts carry one and the layout not, or the reverse")
        elif self.pqs is not None:
            problems.expect_equal("pre_quant_scale (BF16)", floats(mod.pre_quant_scale, "BF16"), self.pqs)

    def decoded(self, mod, local: int, i: int) -> dict[str, Any]:
        """The stored bytes of local expert ``local`` after the target's inverse transforms, by role in
        the order they are checked; row orders undone as views where they can be (``Halves``)."""
        h, layout = mod.hidden, self.layout

        def rows(stored: np.ndarray, gated: bool):
            v = layout.moe_rows_halves(stored, gated)
            return layout.moe_rows_decode(stored, gated) if v is None else Halves(v)

        return {
            "w13_weight": lambda: rows(mod.w13_weight[local], True),
            "w13_weight_scale": lambda: rows(unswizzle(
                mod.w13_weight_scale[local], 2 * i, h // 16, f"{mod.name}.w13_weight_scale[{local}]"), True),
            "w2_weight": lambda: rows(mod.w2_weight[local], False),
            "w2_weight_scale": lambda: rows(unswizzle(
                mod.w2_weight_scale[local], h, i // 16, f"{mod.name}.w2_weight_scale[{local}]"), False)}

    def expected(self, ex, i_slice: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        """What ``decoded`` must hold for source expert ``ex``, by role: parts laid end to end on dim 0."""
        (i0, i1), src = i_slice, self.src
        s1, s3 = src.scalar(ex.gate, WEIGHT_SCALE_2), src.scalar(ex.up, WEIGHT_SCALE_2)
        big = np.maximum(s1, s3)

        def part(m, role):
            return src.arr(m.tensors[role].name)

        return {"w13_weight": [part(ex.up, WEIGHT)[i0:i1], part(ex.gate, WEIGHT)[i0:i1]],
                "w13_weight_scale": [apply_table("rescale", part(ex.up, WEIGHT_SCALE)[i0:i1], s3, big),
                                     apply_table("rescale", part(ex.gate, WEIGHT_SCALE)[i0:i1], s1, big)],
                "w2_weight": [part(ex.down, WEIGHT)[:, i0 // 2:i1 // 2]],
                "w2_weight_scale": [part(ex.down, WEIGHT_SCALE)[:, i0 // 16:i1 // 16]]}

    def expert_bytes(self, mod, i_slice: tuple[int, int]):
        i = i_slice[1] - i_slice[0]

        def one(local: int, ex, found: Problems) -> None:
            got = self.decoded(mod, local, i)
            for role, parts in self.expected(ex, i_slice).items():
                what = f"{role} (expert {ex.index})"
                if len(parts) == 1:
                    found.expect_equal(what, got[role](), parts[0])
                else:
                    found.expect_parts(what, got[role](), parts)

        return one

    def expert_gemms(self, mod, local: int, i: int):
        """One expert through the emulated kernel: GEMM1 out, GEMM2 out, the kernel's intermediate
        dequantized, and GEMM1's threshold."""
        layout, h = self.layout, mod.hidden
        w13 = layout.moe_rows_decode(mod.w13_weight[local], gated=True)
        bs13 = layout.moe_rows_decode(unswizzle(mod.w13_weight_scale[local], 2 * i, h // 16, "w13"), gated=True)
        w2 = layout.moe_rows_decode(mod.w2_weight[local], gated=False)
        bs2 = layout.moe_rows_decode(unswizzle(mod.w2_weight_scale[local], h, i // 16, "w2"), gated=False)
        x = self.scaled(self.x, None if mod.pre_quant_scale is None else floats(mod.pre_quant_scale, "BF16"))
        o1 = scaled_matmul(nvfp4_quant(x, mod.a1_gscale[local]), w13, bs13) * mod.g1_alphas[local]
        act = silu(o1[:, i:]) * o1[:, :i]  # FlashInfer: act(second half) * first half
        ha = nvfp4_quant(act, mod.a2_gscale[local])
        o2 = scaled_matmul(ha, w2, bs2) * mod.g2_alphas[local]
        ex = self.layer.experts[mod.expert_offset + local]
        rescaled = self.src.scalar(ex.gate, WEIGHT_SCALE_2) != self.src.scalar(ex.up, WEIGHT_SCALE_2)
        return o1, o2, ha / mod.a2_gscale[local], self.limits.unified if rescaled else self.limits.kept

    def stages(self, mod, off: int, i_slice: tuple[int, int]):
        """GEMM1 against the source; GEMM2 on the kernel's own intermediate. Returns kernel, emulated,
        stage errors, (error, threshold) of the worst stage relative to its threshold, per-expert outputs."""
        i0, i1 = i_slice
        sample = pick_experts(mod.experts, CPU_SAMPLE_EXPERTS, self.opts.seed, mod.name)
        stages = Stages(len(sample))
        outs: dict[int, tuple] = {}
        for local in sample:
            gid = off + local
            ref1 = self.gemm1_ref(gid, rows=i_slice)
            o1, o2, h_true, t1 = self.expert_gemms(mod, local, i1 - i0)
            ref2 = self.src.nvfp4_matmul(h_true, self.layer.experts[gid].down, cols=i_slice)
            stages.add("gemm1", rel_error(o1, ref1), t1)
            stages.add("gemm2", rel_error(o2, ref2), self.limits.gemm2)
            outs[gid] = (o1, o2, h_true)
        return self.label, True, stages.errors, stages.result(), outs

    def fused(self, fp4, ck, mod):  # pragma: no cover - FlashInfer's fused kernel, sm_100+
        """FlashInfer's fused kernel gives only the layer output: one end-to-end check with routing."""
        g = rng(self.opts.seed, mod.name + "/routing")
        t, top_k = self.x.shape[0], min(2, mod.experts)
        ids = np.stack([g.permutation(mod.experts)[:top_k] for _ in range(t)])
        logits = g.standard_normal((t, top_k)).astype(np.float32)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        x = self.scaled(self.x, None if mod.pre_quant_scale is None else floats(mod.pre_quant_scale, "BF16"))
        out = fp4.fused_moe(ck, mod.name, x, ids, w)
        ref = np.zeros((t, mod.hidden), dtype=np.float32)
        for e in range(mod.experts):
            tok, slot = np.nonzero(ids == e)
            if not len(tok):
                continue
            ex, xt = self.layer.experts[mod.expert_offset + e], self.ref_in[tok]
            hmid = silu(self.src.nvfp4_matmul(xt, ex.gate)) * self.src.nvfp4_matmul(xt, ex.up)
            np.add.at(ref, tok, self.src.nvfp4_matmul(self.quant(hmid, self.a2), ex.down) * w[tok, slot, None])
        err = rel_error(out, ref)
        return "flashinfer.cutlass_fused_moe", False, {"fused": err}, (err, FUSED_MOE_THRESHOLD), None


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_moe(name, infos, ctx, Nvfp4Moe)
