"""NVFP4 modules of a converted output, checked with numpy alone: every byte of every weight and block
scale, every derived scale, emulated GEMMs against the source, and the cross-rank properties of
SEMANTICS §10 (the checks ``mocli.plan.dense`` and ``mocli.plan.moe`` answer to for NVFP4).

An NVFP4 conversion only moves bytes and never loads torch; its check need not either. The e2m1
products and e4m3 block scales are exact in float32, so numpy's float32 GEMMs are the same emulation
torch ran, and importing torch alone took longer than the whole conversion (3.4 s against 2.6-3.2 s
on the H200 machine). Torch comes in only for FlashInfer's NVFP4 kernels (sm_100+), through
``Fp4Kernels``; the dense FP8 checks are ``dense`` and ``moe``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from mocli import trace
from mocli.census import Module
from mocli.errors import CorruptFileError
from mocli.kinds import ModuleKind, Role
from mocli.numerics import E2M1_MAX, FP8_MAX
from mocli.numerics.in_numpy import E4M3, dequant_nvfp4, nvfp4_quant, scaled_matmul, silu
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import TargetLayout
from mocli.targets.decode import LayoutError, unswizzle
from mocli.verify.cross import dense_cross, moe_cross
from mocli.verify.expect import apply_table
from mocli.verify.results import (
    CPU_SAMPLE_EXPERTS,
    FUSED_MOE_THRESHOLD,
    THRESHOLDS,
    CrossResult,
    Halves,
    ModuleResult,
    Problems,
    Stages,
    offsets_of,
    pick_experts,
    rank_check,
    rank_slices,
    rel_error,
    rng,
    sample_rows,
    take_bytes,
)

KINDS = (ModuleKind.NVFP4_LINEAR, ModuleKind.NVFP4_MOE)
EMULATED = "emulated NVFP4 (decoded layout, exact products)"
EMULATED_MOE = "emulated NVFP4 MoE (decoded layout, exact products)"
ONE = np.float32(1)


def floats(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of a safetensors tensor read as numpy (``TensorReader.array``: BF16 and F8 as
    their raw words)."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E4M3":
        return E4M3[a]
    return a.astype(np.float32)


class NpSource:
    """Source tensors on demand, as read-only numpy views of the page cache."""

    def __init__(self, ckpt, census, reader) -> None:
        self.ckpt, self.census, self.reader = ckpt, census, reader
        self.layers = {layer.name: layer for layer in census.moe}

    def arr(self, name: str) -> np.ndarray:
        return self.reader.array(self.ckpt.tensors[name])

    def floats(self, name: str) -> np.ndarray:
        return floats(self.arr(name), self.ckpt.tensors[name].dtype)

    def module(self, name: str) -> Module:
        return self.census.modules[name]

    def scalar(self, m: Module, suffix: str) -> np.float32:
        name = m.tensors[suffix].name
        v = self.floats(name)
        if v.size != 1:
            raise CorruptFileError(f"{name}: a per-tensor scale with {v.size} values",
                                   hint="the source is not the per-tensor NVFP4 export it was converted from")
        return np.float32(v.reshape(()))

    def dequant(self, m: Module, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 [N, K] of one source linear (or its ``rows``), from its own scales."""
        w, bs = self.arr(m.tensors[WEIGHT].name), self.arr(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w, bs = w[rows], bs[rows]
        return dequant_nvfp4(w, bs, self.scalar(m, WEIGHT_SCALE_2))

    def matmul(self, x: np.ndarray, m: Module, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> np.ndarray:
        """``x @ W.T`` for the source linear W dequantized from its own scales (``rows`` / ``cols``: a
        slice of W's output / input dims), without W ever whole in float32 (``scaled_matmul``)."""
        w, bs = self.arr(m.tensors[WEIGHT].name), self.arr(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w, bs = w[rows[0]:rows[1]], bs[rows[0]:rows[1]]
        if cols is not None:
            w, bs = w[:, cols[0] // 2:cols[1] // 2], bs[:, cols[0] // 16:cols[1] // 16]
        return scaled_matmul(x, w, bs, self.scalar(m, WEIGHT_SCALE_2))


class Fp4Kernels:
    """FlashInfer's NVFP4 kernels (sm_100+), where they run: the one part of an NVFP4 check that needs
    torch. ``rt`` is a ``mocli.verify.common.Runtime`` whose ``fp4_kernels()`` holds."""

    def __init__(self, rt) -> None:
        self.rt = rt

    def mm(self, ck, name: str, xr: np.ndarray) -> np.ndarray:  # pragma: no cover - sm_100+
        import torch

        from mocli.verify import flashinfer_args

        mod = ck.load_module(name, self.rt.device)
        return flashinfer_args.run_mm_fp4(mod, torch.from_numpy(xr).to(self.rt.device)).cpu().numpy()

    def fused_moe(self, ck, name: str, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:  # pragma: no cover
        import torch

        from mocli.verify import flashinfer_args

        mod = ck.load_module(name, self.rt.device)
        t = [torch.from_numpy(a).to(self.rt.device) for a in (x, ids, w)]
        return flashinfer_args.run_cutlass_fused_moe_nvfp4(mod, *t).cpu().numpy()


# --- dense (SEMANTICS §6) -------------------------------------------------------------------------------

def check_dense(name: str, infos: dict[int, dict], cks: dict, src: NpSource, layout: TargetLayout, opts, tp: int,
                heads, fp4: Fp4Kernels | None = None) -> tuple[list[ModuleResult], CrossResult | None]:
    """One NVFP4 linear on every given rank, then (all ranks given) the column-concat / row-sum
    property. Bytes are compared for every row; GEMMs run on up to NUMERIC_ROWS sampled rows."""
    first = next(iter(infos.values()))
    kind = ModuleKind(first["kind"])
    shards = [src.module(n) for n in first["sources"]]
    s2 = [src.scalar(m, WEIGHT_SCALE_2) for m in shards]
    big_s2 = np.max(s2)  # numpy's max: a NaN scale stays NaN (and fails), as torch's did
    big_a = np.max([src.scalar(m, INPUT_SCALE) for m in shards])
    limits = THRESHOLDS[kind]
    threshold = limits.unified if any(v != big_s2 for v in s2) else limits.kept

    def quant(x: np.ndarray) -> np.ndarray:  # the activations as the kernel quantizes them, dequantized
        return nvfp4_quant(x, ONE / big_a) * big_a

    k_full = shards[0].out_in[1]
    x = rng(opts.seed, name).standard_normal((opts.tokens, k_full), dtype=np.float32) * np.float32(
        float(big_a) * FP8_MAX * E2M1_MAX / 4)
    offsets = offsets_of(shards)
    sample = sample_rows(shards, offsets, opts.seed, name)  # sorted full-layer rows
    w_sample = np.concatenate([src.dequant(m, local) for m, off in zip(shards, offsets, strict=True)
                               if len(local := sample[(sample >= off) & (sample < off + m.out_in[0])] - off)])
    bias_full = np.concatenate([src.floats(m.tensors["bias"].name) for m in shards]) \
        if "bias" in shards[0].tensors else None
    results, outs = [], {}
    xq_full = None
    for rank, info in infos.items():
        meta = info["meta"]
        with rank_check(results, name, rank, info, kind, threshold) as (res, problems):
            slices, split = rank_slices(info, shards, tp, heads, problems)
            mod = cks[rank].module_arrays(name)
            n, k = mod.n, mod.k
            problems.scalar("weight_scale_2", mod.weight_scale_2, big_s2)
            problems.scalar("input_scale", mod.input_scale, big_a)
            problems.scalar("alpha", mod.alpha, big_a * big_s2)
            problems.scalar("input_scale_inv", mod.input_scale_inv, ONE / big_a)
            w = layout.nvfp4_weight_decode(mod.weight, n, k, f"{name}.weight")
            bs = layout.nvfp4_scale_decode(mod.weight_scale, n, k // 16, f"{name}.weight_scale")
            problems.expect_parts("weight", w, [src.arr(m.tensors[WEIGHT].name)[r0:r1, c0 // 2:c1 // 2]
                                                for m, (r0, r1, c0, c1) in zip(shards, slices, strict=True)])
            problems.expect_parts("weight_scale (block scales)", bs, [
                apply_table("rescale", src.arr(m.tensors[WEIGHT_SCALE].name)[r0:r1, c0 // 16:c1 // 16], si, big_s2)
                for m, si, (r0, r1, c0, c1) in zip(shards, s2, slices, strict=True)])
            c0, c1 = slices[0][2], slices[0][3]
            held = np.concatenate([np.arange(a, b) + off for (a, b, _, _), off in zip(slices, offsets, strict=True)])
            local_rows = np.nonzero(np.isin(held, sample))[0]  # the rank's rows (local) that were sampled
            global_rows = held[local_rows]
            cols = np.searchsorted(sample, global_rows)  # their place among the sampled rows
            xr = x[:, c0:c1]
            with np.errstate(all="ignore"):  # a broken scale gives inf/NaN, which fails the check (no warning)
                if fp4 is not None:
                    out, res.kernel = fp4.mm(cks[rank], name, xr)[:, local_rows], "flashinfer.mm_fp4"
                else:
                    xa = nvfp4_quant(xr, mod.input_scale_inv)  # e2m1 * sf: exact in float32
                    out = scaled_matmul(xa, w[local_rows], bs[local_rows]) * mod.alpha
                    res.kernel, res.emulated = EMULATED, True
                xq_r = quant(xr)
                if split == "row":
                    ref = xq_r @ w_sample[:, c0:c1].T
                else:
                    if xq_full is None:  # the same for every rank; the rank's own when it holds every column
                        xq_full = xq_r if (c0, c1) == (0, k_full) else quant(x)
                    ref = (xq_full @ w_sample.T)[:, cols]
                if getattr(mod, "bias", None) is not None:
                    problems.expect_parts("bias", mod.bias, [src.arr(m.tensors["bias"].name)[a:e]
                                                             for m, (a, e, _, _) in zip(shards, slices, strict=True)])
                    # the engine adds a row-parallel bias once, after the all-reduce: rank 0 carries it here
                    if split != "row" or meta.get("tp_rank", 0) == 0:
                        out = out + floats(mod.bias, cks[rank].entry(info["tensors"]["bias"]).dtype)[local_rows]
                        ref = ref + bias_full[global_rows]
                res.error = rel_error(out, ref)
            outs[rank] = (split, cols, xq_r, out, meta.get("tp_rank", 0))
    cross = None
    if len(outs) > 1 and len(outs) == len(infos):
        with np.errstate(all="ignore"):
                cross = dense_cross(name, outs, x, quant, threshold, w_sample,
                                None if bias_full is None else bias_full[sample])
    return results, cross


# --- MoE (SEMANTICS §7) ----------------------------------------------------------------------------------

class _Layer:
    """One NVFP4 MoE layer's source side: scales, activations, dequantized experts on demand."""

    def __init__(self, name: str, src: NpSource, layout: TargetLayout, opts) -> None:
        self.name, self.src, self.layout, self.opts = name, src, layout, opts
        self.layer = src.layers[name]
        self.limits = THRESHOLDS[ModuleKind.NVFP4_MOE]
        every = [self.layer.experts[e] for e in sorted(self.layer.experts)]
        self.a13 = np.max([np.maximum(src.scalar(e.gate, INPUT_SCALE), src.scalar(e.up, INPUT_SCALE)) for e in every])
        self.a2 = np.max([src.scalar(e.down, INPUT_SCALE) for e in every])
        self.x = rng(opts.seed, name).standard_normal((opts.tokens, self.layer.hidden), dtype=np.float32) \
            * np.float32(float(self.a13) * FP8_MAX * E2M1_MAX / 4)
        self.ref_in = self.quant(self.x, self.a13)

    @staticmethod
    def quant(x: np.ndarray, a) -> np.ndarray:
        """Activations as the kernel quantizes them with the per-tensor input scale ``a``, dequantized."""
        return nvfp4_quant(x, ONE / a) * a

    def gemm1_ref(self, gid: int, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The source expert's GEMM1 of the reference input, [up | gate] (``rows``: the intermediate
        slice of each), with W dequantized a block of rows at a time (``NpSource.matmul``)."""
        ex = self.layer.experts[gid]
        return np.concatenate([self.src.matmul(self.ref_in, ex.up, rows=rows),
                               self.src.matmul(self.ref_in, ex.gate, rows=rows)], axis=1)

    def reference(self, gid: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``moe_cross``'s full GEMM1 and GEMM2 (of ``h``) for a global expert."""
        return self.gemm1_ref(gid), self.src.matmul(h, self.layer.experts[gid].down)

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

    def all_bytes(self, mod, experts, i_slice: tuple[int, int]) -> tuple[Problems, Exception | None]:
        """Every expert's bytes of one rank: the differences in expert order, and the layout fault that
        stopped the check, if one did (the differences found before it are kept)."""
        found = Problems()
        i = i_slice[1] - i_slice[0]
        trace.mark(f"{mod.name}: expert bytes started")
        try:
            for local, ex in enumerate(experts):
                got = self.decoded(mod, local, i)
                for role, parts in self.expected(ex, i_slice).items():
                    what = f"{role} (expert {ex.index})"
                    if len(parts) == 1:
                        found.expect_equal(what, got[role](), parts[0])
                    else:
                        found.expect_parts(what, got[role](), parts)
        except (LayoutError, CorruptFileError) as e:
            return found, e
        trace.mark(f"{mod.name}: expert bytes done")
        return found, None

    def expert_gemms(self, mod, local: int, i: int):
        """One expert through the emulated kernel: GEMM1 out, GEMM2 out, the kernel's intermediate
        dequantized, and GEMM1's threshold."""
        layout, h = self.layout, mod.hidden
        w13 = layout.moe_rows_decode(mod.w13_weight[local], gated=True)
        bs13 = layout.moe_rows_decode(unswizzle(mod.w13_weight_scale[local], 2 * i, h // 16, "w13"), gated=True)
        w2 = layout.moe_rows_decode(mod.w2_weight[local], gated=False)
        bs2 = layout.moe_rows_decode(unswizzle(mod.w2_weight_scale[local], h, i // 16, "w2"), gated=False)
        o1 = scaled_matmul(nvfp4_quant(self.x, mod.a1_gscale[local]), w13, bs13) * mod.g1_alphas[local]
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
            ref2 = self.src.matmul(h_true, self.layer.experts[gid].down, cols=i_slice)
            stages.add("gemm1", rel_error(o1, ref1), t1)
            stages.add("gemm2", rel_error(o2, ref2), self.limits.gemm2)
            outs[gid] = (o1, o2, h_true)
        return EMULATED_MOE, True, stages.errors, stages.result(), outs

    def fused(self, fp4: Fp4Kernels, ck, mod):  # pragma: no cover - FlashInfer's fused kernel, sm_100+
        """FlashInfer's fused kernel gives only the layer output: one end-to-end check with routing."""
        g = rng(self.opts.seed, mod.name + "/routing")
        t, top_k = self.x.shape[0], min(2, mod.experts)
        ids = np.stack([g.permutation(mod.experts)[:top_k] for _ in range(t)])
        logits = g.standard_normal((t, top_k)).astype(np.float32)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out = fp4.fused_moe(ck, mod.name, self.x, ids, w)
        ref = np.zeros((t, mod.hidden), dtype=np.float32)
        for e in range(mod.experts):
            tok, slot = np.nonzero(ids == e)
            if not len(tok):
                continue
            ex, xt = self.layer.experts[mod.expert_offset + e], self.ref_in[tok]
            hmid = silu(self.src.matmul(xt, ex.gate)) * self.src.matmul(xt, ex.up)
            np.add.at(ref, tok, self.src.matmul(self.quant(hmid, self.a2), ex.down) * w[tok, slot, None])
        err = rel_error(out, ref)
        return "flashinfer.cutlass_fused_moe", False, {"fused": err}, (err, FUSED_MOE_THRESHOLD), None


# Modules checked at once where there are cores for them (numpy drops the GIL in its loops, copies and
# GEMMs): one on the 2-core build machine, whose second core hashes and checks bytes; up to four on
# larger machines. Each MoE check's expert bytes go to a thread of their own beside its GEMMs.
WORKERS = max(1, min(4, (os.cpu_count() or 1) // 4))
_BYTES = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="mocli-verify-bytes")


def check_moe(name: str, infos: dict[int, dict], cks: dict, src: NpSource, layout: TargetLayout, opts,
              fp4: Fp4Kernels | None = None) -> tuple[list[ModuleResult], CrossResult | None]:
    """One NVFP4 MoE layer on every given rank: bytes of every expert, consistency, stage-wise numerics
    on a sample of experts; then (tensor parallel, all ranks) the concatenation / sum over ranks."""
    kind = ModuleKind.NVFP4_MOE
    case = _Layer(name, src, layout, opts)
    results, per_rank = [], {}
    for rank, info in infos.items():
        meta = info["meta"]
        with rank_check(results, name, rank, info, kind, 0.0) as (res, problems):
            mod = cks[rank].module_arrays(name)
            off = meta.get("expert_offset", 0)
            i_slice = tuple(meta.get("intermediate_slice", [0, meta["intermediate"]]))
            experts = [case.layer.experts[off + e] for e in range(mod.experts)]
            case.consistency(mod, experts, problems)
            found: Future = _BYTES.submit(case.all_bytes, mod, experts, i_slice)
            try:
                with np.errstate(all="ignore"):  # a broken scale gives inf/NaN, which fails the check below
                    numbers = case.fused(fp4, cks[rank], mod) if fp4 is not None else case.stages(mod, off, i_slice)
            finally:
                take_bytes(found, problems)
            res.kernel, res.emulated, res.stages, (res.error, res.threshold), outs = numbers
            if outs is not None:
                per_rank[rank] = (i_slice, outs)
    cross = None
    if len({i_slice for i_slice, _ in per_rank.values()}) > 1 and len(per_rank) == len(infos):
        with np.errstate(all="ignore"):
            cross = moe_cross(name, per_rank, case.reference, case.layer.intermediate, case.limits)
    return results, cross
