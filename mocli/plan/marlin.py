"""The marlin target's planners: NVFP4 and W4A16_NVFP4 linears and MoE layers in vLLM's Marlin layout,
per rank (SEMANTICS §13.5-§13.6, §10 slicing first, then padding and repack per rank).

As vLLM's preparation, with mocli's policy where shards or an expert's w1/w3 disagree on their global
scale (the max, the others' block scales rescaled: §6/§7, reported). The power-of-two ``scale_factor``
of each Marlin scale tensor depends on its largest block scale, so planning reads the block scales
once (their maxima, per rank) before any unit runs; the units then move bytes in numpy
(``mocli.ops.marlin``), without torch, or an expert's weights through the GPU in torch where a CUDA run
sends them there (``mocli.ops.marlin_torch``, ``mocli.stream.job.GPU_UNITS``): the same bytes.
Activations are BF16 (``ACT_DTYPE``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from mocli.census import Module
from mocli.kinds import Role
from mocli.ops import fp8, marlin, marlin_torch
from mocli.plan.context import QUANT_SUFFIXES, PlanContext
from mocli.plan.core import F32, ConvertedModule
from mocli.plan.dense import _Dense, check_fp8
from mocli.plan.moe import _Moe
from mocli.stream.units import OutTensor, Piece, Unit, concat_pieces
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets.marlin import REPACK

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext

ACT_DTYPE = "bfloat16"  # the activation dtype the scales are built for (fp16 gives other bytes)
PART_BYTES = 2 << 20  # a dense weight's bytes per repack unit (``_MarlinDense._weight_parts``)


def _top_code(pc: PlanContext, m: Module, rows: tuple[int, int] | None = None,
              cols: tuple[int, int] | None = None) -> int:
    """The largest non-negative, non-NaN e4m3 code of a block-scale slice (codes 0..0x7E order as their
    values do): read at plan time, for the scale factor."""
    a = pc.reader.array(m.tensors[WEIGHT_SCALE])
    a = a[rows[0]:rows[1]] if rows else a
    a = a[:, cols[0]:cols[1]] if cols else a
    top = int(a.max()) if a.size else 0
    return top if top < 0x7F else int(np.where(a < 0x7F, a, 0).max())


def _top_codes(pc: PlanContext, asks: list[tuple[Module, tuple[int, int] | None, tuple[int, int] | None]]) -> np.ndarray:
    """``_top_code`` of each (module, rows, cols) at once: their rows' byte maxima in one pass over each file
    (``TensorReader.byte_maxima``), each one at or above 0x7F (a NaN or negative code) and each column slice
    (w2 under TP) looked at alone."""
    spans, alone = [], []
    for k, (m, rows, cols) in enumerate(asks):
        entry = m.tensors[WEIGHT_SCALE]
        width = entry.shape[-1]
        if cols and cols != (0, width):
            alone.append(k)
        spans.append((entry, rows[0] * width, rows[1] * width) if rows else (entry, 0, entry.nbytes))
    tops = pc.reader.byte_maxima(spans).astype(np.int64)
    for k in [*alone, *np.flatnonzero(tops >= 0x7F).tolist()]:
        tops[k] = _top_code(pc, *asks[k])
    return tops


def _rescaled_top(pc: PlanContext, m: Module, s2, big, **where) -> int:
    return int(fp8.rescale_codes(_top_code(pc, m, **where), s2, big))


@lru_cache(maxsize=256)
def _factor(top: int) -> float:
    """vLLM's scale factor of block scales whose largest code is ``top``."""
    return marlin.scale_factor(np.array([top], dtype=np.uint8), ACT_DTYPE)


def _settled(top: int) -> bool:
    """Whether codes up to ``top`` fix the scale factor whatever larger ones follow: it is 1 and ``top`` is
    a positive scale (all-zero scales give 1 too, but a later positive one may raise it)."""
    return top > 0 and _factor(top) == 1.0


def _unify(pc: PlanContext, s2: list, what: str) -> np.float32:
    """S2 = max (mocli policy, SEMANTICS §6/§7); the ones below it are counted (``what``: shards or experts)."""
    big = np.stack(s2).max()
    rescaled = sum(bool(x != big) for x in s2)
    counts = pc.plan.unified_scales
    counts[f"nvfp4_rescaled_{what}"] += rescaled
    if rescaled:
        counts["nvfp4_worst_scale_2_ratio"] = max(counts["nvfp4_worst_scale_2_ratio"], float(big / np.stack(s2).min()))
    return big


class _MarlinBias:
    """The Marlin bias of a dense module, shared by NVFP4 (``_MarlinDense``) and MXFP4
    (``mocli.plan.mxfp4_marlin``): padded to Np and permuted, dtype unchanged."""

    def _plan_bias(self) -> None:
        """A Marlin bias is padded to Np and permuted (``marlin_permute_bias``)."""
        biases = self._bias_entries()
        if not biases:
            return
        for r in self.ranks:
            sl = self.slice_of(r)
            np_, _ = marlin.padded_nk(sl.n, sl.k)
            self.add(r, Role.BIAS, biases[0].dtype, (np_,), [b.name for b in biases],
                     self.fused + self.slice_transforms() + ["marlin_pad", "marlin_permute_bias"])
            for m in self.pc.plan.modules[-len(self.ranks):]:
                if m.group == self.pc.parallel.group(r):
                    m.tensors[str(Role.BIAS)] = f"{self.prefix}.{Role.BIAS}"

    def _bias(self, ctx: UnitContext, shape: dict) -> list[Piece]:
        biases = self._bias_entries()
        if not biases:
            return []
        whole = [ctx.array(b) for b in biases]  # bytes, one row per element
        pieces = []
        for r in self.ranks:
            sl = self.slice_of(r)
            rows = np.concatenate([w[a:b] for w, (a, b) in zip(whole, sl.rows, strict=True)])
            pieces.append(Piece(self.key(r, Role.BIAS), 0, marlin.permute_bias(rows, shape[sl.tp_rank][0])))
        return pieces


class _MarlinDense(_MarlinBias, _Dense):
    """A linear (a fused group or alone): weight repacked, block scales permuted and rewritten, the
    global scale ×2^119/sf, per tp rank; a W4A4 source's input scale kept as metadata."""

    def plan(self) -> None:
        pc, shards = self.pc, self.shards
        s2 = [pc.scale(m, WEIGHT_SCALE_2) for m in shards]
        big = _unify(pc, s2, "shards")
        w4a4 = all(INPUT_SCALE in m.tensors for m in shards)
        big_a = np.stack([pc.scale(m, INPUT_SCALE) for m in shards]).max() if w4a4 else None
        weights, bscales = [m.tensors[WEIGHT] for m in shards], [m.tensors[WEIGHT_SCALE] for m in shards]
        shape, sf = {}, {}
        for t, sl in self.slices.items():
            shape[t] = marlin.padded_nk(sl.n, sl.k)
            sf[t] = marlin.scale_factor(np.array([max(
                _rescaled_top(pc, m, si, big, rows=(a, b), cols=(sl.cols[0] // 16, sl.cols[1] // 16))
                for m, si, (a, b) in zip(shards, s2, sl.rows, strict=True))], dtype=np.uint8), ACT_DTYPE)
        for r in self.ranks:
            (np_, kp), rows = shape[self.slice_of(r).tp_rank], self.slice_transforms()
            self.add(r, Role.WEIGHT, "I32", (kp // 16, 2 * np_), [w.name for w in weights],
                     self.fused + rows + ["marlin_pad", REPACK])
            self.add(r, Role.WEIGHT_SCALE, "F8_E4M3", (kp // 16, np_), [b.name for b in bscales], self.fused + rows + (
                ["rescale_to_max_scale_2"] if any(x != big for x in s2) else []) + ["marlin_pad", "marlin_permute_scales",
                                                                                    "nvfp4_marlin_process_scales"])
            self.add(r, Role.WEIGHT_GLOBAL_SCALE, "F32", (), self.sources(WEIGHT_SCALE_2), ["max", "* 2^119 / sf"])
            if w4a4:
                self.add(r, Role.INPUT_GLOBAL_SCALE, "F32", (), self.sources(INPUT_SCALE), ["max (unused by Marlin)"])
        glob = {r: pc.plan.computed_value(self.key(r, Role.WEIGHT_GLOBAL_SCALE),
                                          marlin.global_scale(big, sf[self.slice_of(r).tp_rank], ACT_DTYPE))
                for r in self.ranks}
        inputs = {r: pc.plan.computed_value(self.key(r, Role.INPUT_GLOBAL_SCALE), big_a) for r in self.ranks} if w4a4 else {}

        def run(ctx: UnitContext) -> list[Piece]:
            bs = [fp8.rescale_block_scales(_checked(ctx, b), si, big) for b, si in zip(bscales, s2, strict=True)]
            pieces: list[Piece] = []
            for t, sl in self.slices.items():
                (np_, kp), (c0, c1) = shape[t], sl.cols
                codes = np.concatenate([x[a:b, c0 // 16:c1 // 16] for x, (a, b) in zip(bs, sl.rows, strict=True)])
                scales = marlin.permute_scales(codes, np_, kp, marlin.scale_table(sf[t]))
                for r in (r for r in self.ranks if self.pc.parallel.tp_rank(r) == t):
                    pieces += [Piece(self.key(r, Role.WEIGHT_SCALE), 0, scales), Piece(self.key(r, Role.WEIGHT_GLOBAL_SCALE), 0, glob[r])]
                    pieces += [Piece(self.key(r, Role.INPUT_GLOBAL_SCALE), 0, inputs[r])] if w4a4 else []
            return pieces + self._bias(ctx, shape)

        self.finish(lambda r: {"padded_n": shape[self.slice_of(r).tp_rank][0], "padded_k": shape[self.slice_of(r).tp_rank][1],
                               "scale_factor": sf[self.slice_of(r).tp_rank], "act_dtype": ACT_DTYPE},
                    bscales, run, self._weight_parts(weights, shape))

    def _weight_parts(self, weights: list, shape: dict[int, tuple[int, int]]) -> tuple[Unit, ...]:
        """The weight repacked in parts of about ``PART_BYTES``, each its rows [kt0, kt1) of every rank's
        [Kp/16, 8 Np] (the repack of K columns [16 kt0, 16 kt1) alone: Marlin's tiles do not cross kt).
        One unit for a 14 MB qkv took an H200 host's worker 40-60 ms before anything could be written;
        in parts the workers share it."""
        total = sum(e.nbytes for e in weights)
        parts = max(1, min(-(-total // PART_BYTES), min(kp // 16 for _, kp in shape.values())))

        def part(i: int):
            def run(ctx: UnitContext) -> list[Piece]:
                pieces = []
                for t, sl in self.slices.items():
                    (np_, kp), (c0, c1) = shape[t], sl.cols
                    kt0, kt1 = kp // 16 * i // parts, kp // 16 * (i + 1) // parts
                    a0 = c0 // 2 + 8 * kt0
                    a1 = max(a0, min(c0 // 2 + 8 * kt1, c1 // 2))  # columns past K are padding
                    w = np.concatenate([ctx.array(e)[a:b, a0:a1] for e, (a, b) in zip(weights, sl.rows, strict=True)])
                    out = marlin.repack(w, np_, 16 * (kt1 - kt0))
                    pieces += [Piece(self.key(r, Role.WEIGHT), kt0 * 8 * np_, out) for r in self.ranks
                               if self.pc.parallel.tp_rank(r) == t]
                return pieces
            return run

        key = [self.key(r, Role.WEIGHT) for r in self.ranks]
        return tuple(Unit(f"dense:{self.prefix}:w{i}", weights, key, part(i), True, torch_free=True,
                          reads=total * (i + 1) // parts - total * i // parts) for i in range(parts))

def _on_gpu(ctx: UnitContext) -> bool:
    """The run has a CUDA device (``convert --device cuda``): an expert's weights are repacked there, in
    torch (``mocli.ops.marlin_torch``: the same bytes); everything else, and any CPU run, in numpy."""
    return ctx.device is not None and ctx.device.type == "cuda"


def _checked(ctx: UnitContext, entry) -> np.ndarray:
    raw = ctx.array(entry)
    check_fp8(raw, entry)
    return raw


class _MarlinMoe(_Moe):
    """An MoE layer: per expert w13 ([w1; w3], each half padded to Ip: no swap for Marlin) and w2 repacked,
    their block scales permuted and rewritten with one scale factor per tensor and rank (over the rank's
    experts, as vLLM computes it over a layer's), the global scales ×2^119/sf per expert."""

    def plan(self) -> None:
        h = self.h
        s2_1, s2_3, s2_2 = self.per_expert(WEIGHT_SCALE_2)
        w13_s2 = np.maximum(s2_1, s2_3)
        self._count_unified(s2_1, s2_3, w13_s2)
        w4a4 = all(INPUT_SCALE in m.tensors for trio in self.mods for m in trio)
        self.ip = {r: marlin.moe_padded_i(self.i_r(r), h) for r in self.ranks}
        self.sf13, self.sf2 = self._scale_factors(s2_1, s2_3, w13_s2)
        for r in self.ranks:
            e, ip, st = self.local(r), self.ip[r], self.slice_transforms()
            self.add(r, Role.W13_WEIGHT, "I32", (e, h // 16, 4 * ip), self.src("gate", WEIGHT, r) + self.src("up", WEIGHT, r),
                     ["stack_experts"] + st + ["marlin_pad_halves", REPACK])
            self.add(r, Role.W13_WEIGHT_SCALE, "F8_E4M3", (e, h // 16, 2 * ip), self.src("gate", WEIGHT_SCALE, r)
                     + self.src("up", WEIGHT_SCALE, r), ["stack_experts"] + st + ["rescale_to_max_scale_2",
                     "marlin_pad_halves", "marlin_permute_scales", "nvfp4_marlin_process_scales"])
            self.add(r, Role.W2_WEIGHT, "I32", (e, ip // 16, 2 * h), self.src("down", WEIGHT, r),
                     ["stack_experts"] + st + ["marlin_pad", REPACK])
            self.add(r, Role.W2_WEIGHT_SCALE, "F8_E4M3", (e, ip // 16, h), self.src("down", WEIGHT_SCALE, r),
                     ["stack_experts"] + st + ["marlin_pad", "marlin_permute_scales", "nvfp4_marlin_process_scales"])
        vectors = {Role.W13_WEIGHT_SCALE_2: (w13_s2, self.sf13, "max(w1, w3) per expert * 2^119 / sf",
                                             self.src("gate", WEIGHT_SCALE_2) + self.src("up", WEIGHT_SCALE_2)),
                   Role.W2_WEIGHT_SCALE_2: (s2_2, self.sf2, "* 2^119 / sf", self.src("down", WEIGHT_SCALE_2))}
        if w4a4:
            a13, a2 = self.input_scales()
            vectors |= {Role.W13_INPUT_SCALE: (np.full(self.e_count, a13, dtype=F32), None, "max (unused by Marlin)",
                                               self.src("gate", INPUT_SCALE) + self.src("up", INPUT_SCALE)),
                        Role.W2_INPUT_SCALE: (np.full(self.e_count, a2, dtype=F32), None, "max (unused by Marlin)",
                                              self.src("down", INPUT_SCALE))}
        if self.pc.units:  # none in a plan only judged (their closures alone: 15,616 calls on the header bench)
            for e, (g, u, _) in enumerate(self.mods):
                self._w13_units(e, g, u, s2_1[e], s2_3[e], w13_s2[e])
            for e, (_, _, d) in enumerate(self.mods):
                self._w2_units(e, d)
        self._vectors(vectors)
        for r in self.ranks:
            self.module(r, {"padded_intermediate": self.ip[r], "scale_factor_w13": self.sf13[r],
                            "scale_factor_w2": self.sf2[r], "act_dtype": ACT_DTYPE})

    def _count_unified(self, s2_1, s2_3, w13_s2) -> None:
        """``_unify``'s counts for every expert whose w1 and w3 global scales differ, at once."""
        differ = s2_1 != s2_3
        if differ.any():
            counts = self.pc.plan.unified_scales
            counts["nvfp4_rescaled_experts"] += int(differ.sum())
            worst = float((w13_s2 / np.minimum(s2_1, s2_3))[differ].max())
            counts["nvfp4_worst_scale_2_ratio"] = max(counts["nvfp4_worst_scale_2_ratio"], worst)

    def _scale_factors(self, s2_1, s2_3, w13_s2) -> tuple[dict[int, float], dict[int, float]]:
        """Per rank, vLLM's power-of-two scale factor of w13's and of w2's block scales, from the largest
        (rescaled) code over the rank's experts and rows (rescaling keeps codes in order: the top code's
        rescaled value is the largest rescaled one). A larger code never raises the factor, so the experts
        are read only until it is 1 (``_settled``: a code above 224). Every block-scale tensor of the real
        exports in fixtures/real reaches 256-448, so a layer settles at its first expert and the rest of its
        block scales is not read at plan time (the units read them anyway). The benchmark's synthetic MoE
        (scales in [20, 220], factor 2) reads all 0.44 GB, 30 ms on the build VM and 60 on an H200 host.
        Each batch of experts is one pass per file for w1, w3 and w2 together (``_top_codes``); batches grow eightfold, so a layer of
        128 experts that never settles takes 4 passes."""
        sf13, sf2 = {}, {}
        for r in self.ranks:
            (e0, e1), (i0, i1) = self.experts[r], self.inter[r]
            top13 = top2 = 0
            a, n = e0, 1
            while a < e1 and not (_settled(top13) and _settled(top2)):  # 1, 8, 64, ... experts at a time
                b, mods = min(e1, a + n), self.mods[a:min(e1, a + n)]
                w13, w2 = not _settled(top13), not _settled(top2)
                asks = [(m[j], (i0, i1), None) for j in (0, 1) for m in mods] if w13 else []
                asks += [(m[2], None, (i0 // 16, i1 // 16)) for m in mods] if w2 else []
                tops, k = _top_codes(self.pc, asks), len(mods)  # w1's, w3's, then w2's: one pass per file
                if w13:
                    top13 = max(top13, int(fp8.rescale_codes(tops[:k], s2_1[a:b], w13_s2[a:b]).max()),
                                int(fp8.rescale_codes(tops[k:2 * k], s2_3[a:b], w13_s2[a:b]).max()))
                if w2:
                    top2 = max(top2, int(tops[2 * k if w13 else 0:].max()))
                a, n = b, 8 * n
            sf13[r], sf2[r] = _factor(top13), _factor(top2)
        return sf13, sf2

    def _w13_units(self, e: int, g: Module, u: Module, s2_1, s2_3, big) -> None:
        """[w1; w3], each half repacked (or its scales permuted) straight into its half of the expert's
        columns: Ip is a multiple of 64, so Marlin's column groups split there (no swap for Marlin: it
        computes act(first half) * second half)."""
        h = self.h

        def weights(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, self.ip[r]
            if _on_gpu(ctx):
                import torch

                out = torch.empty((h // 16, 16 * ip), dtype=torch.uint8, device=ctx.device)
                for half, m in enumerate((g, u)):
                    marlin_torch.repack(ctx.rows(m.tensors[WEIGHT], i0, i1).to(ctx.device, non_blocking=True), ip, h,
                                        out=out[:, 8 * ip * half:8 * ip * (half + 1)])
                return [out]
            out = ctx.empty((h // 16, 16 * ip))
            for half, m in enumerate((g, u)):
                marlin.repack(ctx.array(m.tensors[WEIGHT], i0, i1), ip, h, out=out[:, 8 * ip * half:8 * ip * (half + 1)])
            return [out]

        def scales(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, self.ip[r]
            out = ctx.empty((h // 16, 2 * ip))
            for half, (m, s2) in enumerate(((g, s2_1), (u, s2_3))):
                marlin.permute_scales(_checked(ctx, m.tensors[WEIGHT_SCALE])[i0:i1], ip, h, marlin.scale_table(self.sf13[r]),
                                      out=out[:, ip * half:ip * (half + 1)], rescale=fp8.rescale_table(s2, big))
            return [out]

        self.expert_unit("w13", e, Role.W13_WEIGHT, [g.tensors[WEIGHT], u.tensors[WEIGHT]], weights, compute=True, gpu=True, in_place=True)
        self.expert_unit("w13s", e, Role.W13_WEIGHT_SCALE, [g.tensors[WEIGHT_SCALE], u.tensors[WEIGHT_SCALE]], scales, in_place=True)

    def _w2_units(self, e: int, d: Module) -> None:
        def weights(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, self.ip[r]
            if _on_gpu(ctx):
                return [marlin_torch.repack(ctx.load(d.tensors[WEIGHT])[:, i0 // 2:i1 // 2], self.h, ip)]
            return [marlin.repack(ctx.array(d.tensors[WEIGHT])[:, i0 // 2:i1 // 2], self.h, ip, out=ctx.empty((ip // 16, 8 * self.h)))]

        def scales(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            (i0, i1), ip = rows, self.ip[r]
            codes = _checked(ctx, d.tensors[WEIGHT_SCALE])[:, i0 // 16:i1 // 16]
            return [marlin.permute_scales(codes, self.h, ip, marlin.scale_table(self.sf2[r]), out=ctx.empty((ip // 16, self.h)))]

        self.expert_unit("w2", e, Role.W2_WEIGHT, [d.tensors[WEIGHT]], weights, compute=True, gpu=True, in_place=True)
        self.expert_unit("w2s", e, Role.W2_WEIGHT_SCALE, [d.tensors[WEIGHT_SCALE]], scales, in_place=True)

    def _vectors(self, vectors: dict) -> None:
        """Per-expert [E] vectors of each rank's experts; the global scales with the rank's scale factor."""
        values: dict = {}
        for r in self.ranks:
            e0, e1 = self.experts[r]
            for role, (v, factors, how, sources) in vectors.items():
                part = v[e0:e1].astype(F32)
                if factors is not None:  # elementwise: the same float32 products and quotients as one by one
                    part = np.asarray(marlin.global_scale(part, factors[r], ACT_DTYPE), dtype=F32)
                self.add(r, role, "F32", tuple(part.shape), sources if self.pc.parallel.single else
                         [s for s in sources if self._expert_of(s) in range(e0, e1)], [how])
                values[self.key(r, role)] = self.pc.plan.computed_value(self.key(r, role), part)
        self.pc.plan.units.append(Unit(f"scales:{self.p}", [], list(values),
                                       lambda ctx: [Piece(k, 0, v) for k, v in values.items()], torch_free=True))


__all__ = ["ACT_DTYPE", "ConvertedModule", "OutTensor", "QUANT_SUFFIXES", "concat_pieces"]
