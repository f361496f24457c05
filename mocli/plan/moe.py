"""Fused MoE layers per rank: [w3; w1] stacking, scale merging, target row orders (SEMANTICS §4, §7, §10).

One unit per expert reads its w1/w3/w2 once and writes every rank that holds it: all ranks (each
with I/tp of the rows) under tensor parallel, one rank under expert parallel. Per-expert scale
vectors follow their experts; a1/a2 are the max over all experts on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from mocli.census import Module, MoELayer
from mocli.io.safetensors_file import TensorEntry
from mocli.kinds import ModuleKind, Role
from mocli.ops import bf16_bytes, fp8, nvfp4, swizzled_shape
from mocli.parallel import expert_range, intermediate_range
from mocli.plan.context import PlanContext
from mocli.plan.core import F32, ConvertedModule
from mocli.stream.units import BadData, OutTensor, Piece, Unit, concat_pieces
from mocli.tables import INPUT_SCALE, PRE_QUANT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext


class _Moe:
    """One MoE layer, every rank. Subclasses plan one kind; ``plan()`` adds tensors, units, modules."""

    def __init__(self, pc: PlanContext, kind: ModuleKind, name: str, layer: MoELayer) -> None:
        self.pc, self.layer, self.kind = pc, layer, kind
        self.mods = [(layer.experts[e].gate, layer.experts[e].up, layer.experts[e].down) for e in sorted(layer.experts)]
        pc.consume(m for trio in self.mods for m in trio)
        self.e_count, self.i, self.h = len(self.mods), layer.intermediate, layer.hidden
        self.p = layer.name
        par = pc.parallel
        self.ranks = range(par.ranks)
        self.experts = {r: expert_range(self.e_count, par, r) for r in self.ranks}
        self.inter = {r: intermediate_range(self.i, par, r) for r in self.ranks}
        self.tensors: dict[int, dict[str, str]] = {r: {} for r in self.ranks}
        self.outputs: list = []

    # --- bookkeeping ---------------------------------------------------------------------------------

    def group(self, r: int) -> str:
        return self.pc.parallel.group(r)

    def key(self, r: int, role: Role) -> tuple[str, str]:
        return self.group(r), f"{self.p}.{role}"

    def local(self, r: int) -> int:
        e0, e1 = self.experts[r]
        return e1 - e0

    def i_r(self, r: int) -> int:
        a, b = self.inter[r]
        return b - a

    def slice_transforms(self) -> list[str]:
        if self.pc.parallel.single:
            return []
        return ["expert_parallel_slice"] if self.pc.parallel.expert_parallel else ["intermediate_slice"]

    def add(self, r: int, role: Role, dtype: str, shape: tuple[int, ...], sources: list[str], transforms: list[str]) -> None:
        t = OutTensor(f"{self.p}.{role}", dtype, shape, str(role), sources, transforms, self.group(r))
        self.tensors[r][str(role)] = self.pc.plan.add(t)
        self.outputs.append(t.key)

    def src(self, proj: str, suffix: str, r: int | None = None) -> list[str]:
        e0, e1 = self.experts[r] if r is not None else (0, self.e_count)
        names = self._names.get((proj, suffix))
        if names is None:  # once per layer, not per rank and role
            experts = self.layer.experts
            names = self._names[proj, suffix] = [getattr(experts[e], proj).tensors[suffix].name for e in sorted(experts)]
        return names[e0:e1]

    # (the per-layer lookups below are made lazily: _Mxfp4TrtllmMoe builds its layer without this __init__)
    @cached_property
    def _names(self) -> dict[tuple[str, str], list[str]]:
        """(projection, suffix) -> every expert's source tensor name (``src``)."""
        return {}

    def per_expert(self, suffix: str) -> tuple[np.ndarray, ...]:
        """([E] gate, [E] up, [E] down) float32 values of one scale suffix."""
        scales = self.pc.scales
        out = []
        for j in range(3):
            values = [scales[trio[j].tensors[suffix].name] for trio in self.mods]
            try:  # one value each, all () or all [1]: stacked at once (a layer's 384 of them, twice per layer)
                v = np.array(values, dtype=F32).reshape(len(values))
            except ValueError:  # shapes that differ, or more than one value: each reshaped (and refused) alone
                v = np.array([x.reshape(()) for x in values], dtype=F32)
            out.append(v)
        return tuple(out)

    def input_scales(self) -> tuple[np.float32, np.float32]:
        """(a13, a2): max input scale over all experts' w1/w3, and over their w2 (SEMANTICS §4, §7.3)."""
        g, u, d = self.per_expert(INPUT_SCALE)
        return np.maximum(g, u).max(), d.max()

    def holders(self, e: int) -> list[int]:
        if self._everyone is not None:
            return self._everyone
        return [r for r in self.ranks if self.experts[r][0] <= e < self.experts[r][1]]

    @cached_property
    def _everyone(self) -> list[int] | None:
        """Every rank, where each holds every expert (no EP): one list for all (``holders``)."""
        full = (0, self.e_count)
        return list(self.ranks) if all(self.experts[r] == full for r in self.ranks) else None

    @cached_property
    def _slots(self) -> dict[Role, tuple[dict[int, tuple[str, str]], dict[int, int]]]:
        """role -> ``_role_slots``' answer."""
        return {}

    def _role_slots(self, role: Role) -> tuple[dict[int, tuple[str, str]], dict[int, int]]:
        """Per rank, the key of ``role``'s stacked tensor and one expert's bytes in it (looked up once per
        layer and role, not per expert: a layer plans ~500 expert units)."""
        got = self._slots.get(role)
        if got is None:
            keys = {r: self.key(r, role) for r in self.ranks}
            got = self._slots[role] = keys, {r: self.pc.plan.tensors[keys[r]].nbytes // self.local(r) for r in self.ranks}
        return got

    def expert_unit(self, kind: str, e: int, role: Role, inputs: list[TensorEntry], emit: Callable,
                    prepare: Callable = lambda ctx: None, compute: bool = False, gpu: bool = False,
                    in_place: bool = False) -> None:
        """One unit for expert ``e``'s part of ``role`` on every rank that holds it: ``prepare(ctx)``
        once, then per rank ``emit(ctx, prepared, r, (i0, i1))`` gives the rank's bytes of the expert
        (parts laid end to end in its slot of the stacked tensor; ``(i0, i1)``: the rank's rows of I):
        source ranges or numpy arrays, made without torch (``Unit.torch_free``); ``gpu``: or torch tensors on
        the context's CUDA device where the run has one (``Unit.gpu``); ``in_place``: its arrays made by
        ``UnitContext.empty`` (``Unit.in_place``). Nothing where the plan is only judged (``PlanContext.units``)."""
        if not self.pc.units:
            return
        holders = self.holders(e)
        every_key, stride = self._role_slots(role)
        keys = every_key if holders is self._everyone else {r: every_key[r] for r in holders}
        slots = {r: stride[r] * (e - self.experts[r][0]) for r in holders}

        def run(ctx: UnitContext) -> list[Piece]:
            prepared = prepare(ctx)
            return [p for r in holders for p in concat_pieces(keys[r], emit(ctx, prepared, r, self.inter[r]), slots[r])]

        self.pc.plan.units.append(Unit(f"{kind}:{self.p}.{e}", inputs, list(keys.values()), run, compute, torch_free=True,
                                       gpu=gpu, in_place=in_place))

    def plan_vectors(self, vectors: dict[Role, tuple[np.ndarray, str, list[str]]]) -> None:
        """Per-expert [E] vectors sliced to each rank's experts; 0-dim scalars whole everywhere."""
        frozen: dict[tuple[int, Role], np.ndarray] = {}
        for r in self.ranks:
            e0, e1 = self.experts[r]
            for role, (v, how, sources) in vectors.items():
                v = np.asarray(v, dtype=F32)
                part = v[e0:e1].copy() if v.ndim else v.copy()
                self.add(r, role, "F32", tuple(part.shape), sources if self.pc.parallel.single else
                         [s for s in sources if self._expert_of(s) in range(e0, e1)], [how])
                frozen[r, role] = self.pc.plan.computed_value(self.key(r, role), part)
        keys = {(r, role): self.key(r, role) for r, role in frozen}

        self.pc.plan.units.append(Unit(f"scales:{self.p}", [], list(keys.values()),
                                       lambda ctx: [Piece(keys[k], 0, v) for k, v in frozen.items()], torch_free=True))

    def _expert_of(self, name: str) -> int:
        return int(name[len(self.layer.name) + 1:].split(".", 1)[0])

    @cached_property
    def scheme_name(self) -> str:
        """The layer's stored scheme (once per layer: ``MoELayer.schemes`` walks every expert)."""
        return str(next(iter(self.layer.schemes)))

    def module(self, r: int, meta: dict) -> None:
        e0, e1 = self.experts[r]
        meta = {"experts": self.local(r), "intermediate": self.i_r(r), "hidden": self.h,
                "naming": self.layer.naming.style, **meta}
        if not self.pc.parallel.single:
            meta |= {"expert_offset": e0, "experts_total": self.e_count, "intermediate_slice": list(self.inter[r]),
                     "intermediate_total": self.i}
        self.pc.plan.modules.append(ConvertedModule(self.p, str(self.kind), self.scheme_name, self.tensors[r],
                                                    [self.layer.name], meta, self.group(r)))



def _check_bytes(raw: np.ndarray, m: Module, suffix: str) -> None:
    if fp8.has_nan_fp8(raw):
        raise BadData(m.tensors[suffix].name, "FP8 bytes encode NaN (0x7F or 0xFF)")


def checked_weight(m: Module) -> Callable:
    """A unit's ``prepare``: module ``m``'s whole FP8 weight, mapped (``UnitContext.array``), NaN codes refused."""
    def prepare(ctx: UnitContext) -> np.ndarray:
        w = ctx.array(m.tensors[WEIGHT])
        _check_bytes(w, m, WEIGHT)
        return w
    return prepare


class _Fp8Moe(_Moe):

    def plan(self) -> None:
        pc, layout, h = self.pc, self.pc.layout, self.h
        s1, s3, s2 = self.per_expert(WEIGHT_SCALE)
        w13_scale = np.maximum(s1, s3)
        a1, a2 = self.input_scales()
        pc.plan.unified_scales["fp8_requantized_shards"] += int((s1 != w13_scale).sum() + (s3 != w13_scale).sum())
        g1, g2 = w13_scale * a1, s2 * a2
        for r in self.ranks:
            e, i = self.local(r), self.i_r(r)
            st = self.slice_transforms()
            self.add(r, Role.W13_WEIGHT, "F8_E4M3", (e, 2 * i, h), self.src("up", WEIGHT, r) + self.src("gate", WEIGHT, r),
                     ["stack_experts"] + st + ["requantize_max_scale", "rows_w3_w1"] + layout.moe_row_transforms(True))
            self.add(r, Role.W2_WEIGHT, "F8_E4M3", (e, h, i), self.src("down", WEIGHT, r),
                     ["stack_experts"] + st + layout.moe_row_transforms(False))
        a2_inv = np.reciprocal(a2)
        vectors: dict[Role, tuple[np.ndarray, str, list[str]]] = {
            Role.W13_WEIGHT_SCALE: (w13_scale, "max(w1, w3) per expert", self.src("gate", WEIGHT_SCALE) + self.src("up", WEIGHT_SCALE)),
            Role.W2_WEIGHT_SCALE: (s2, "stack_experts", self.src("down", WEIGHT_SCALE)),
            Role.W13_INPUT_SCALE: (a1, "max over experts", self.src("gate", INPUT_SCALE) + self.src("up", INPUT_SCALE)),
            Role.W2_INPUT_SCALE: (a2, "max over experts", self.src("down", INPUT_SCALE)),
            Role.W13_INPUT_SCALE_INV: (np.reciprocal(a1), "1 / w13_input_scale", []),
            Role.W2_INPUT_SCALE_INV: (a2_inv, "1 / w2_input_scale", []),
            Role.G1_ALPHAS: (g1, "w13_weight_scale * w13_input_scale", []),
            Role.G2_ALPHAS: (g2, "w2_weight_scale * w2_input_scale", []),
        }
        vectors |= {role: (v, how, []) for role, (v, how) in layout.moe_extra_scales(self.kind, g1, g2, a2_inv).items()}
        # Units in file order (all experts' w13, then their w2, then the vectors): every output file
        # is appended front to back, which costs the kernel far less than filling a pre-sized file.
        for e, (g, u, _) in enumerate(self.mods):
            self._w13_unit(e, g, u, s1[e], s3[e], w13_scale[e])
        for e, (_, _, d) in enumerate(self.mods):
            self._w2_unit(e, d)
        self.plan_vectors(vectors)
        for r in self.ranks:
            self.module(r, {})

    # FP8 units are numpy on the CPU (``mocli.ops.fp8``): every weight byte checked for NaN codes, the
    # w1/w3 half below the expert's max scale requantized through a 256-entry table, rows permuted for
    # trtllm; bytes no transform touches are copied in the kernel.

    def _w13_unit(self, e: int, g: Module, u: Module, s1, s3, s) -> None:
        layout = self.pc.layout

        def emit(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            # [w3; w1]: FlashInfer computes act(second half) * first half (SEMANTICS §4).
            i0, i1 = rows
            halves = []
            for m, scale in ((u, s3), (g, s1)):
                raw = ctx.array(m.tensors[WEIGHT], i0, i1)  # mapped, not read (UnitContext.array)
                _check_bytes(raw, m, WEIGHT)
                halves.append((m, raw, fp8.requantize_fp8(raw, scale, s, self.pc.census.spelling.fp8_requant_f16)))
            idx = layout.w13_rows(2 * (i1 - i0))
            if idx is not None:
                return [nvfp4.gather_rows([q for _, _, q in halves], idx)]
            # the half already at the max scale is its source bytes: copied in the kernel
            return [ctx.src(m.tensors[WEIGHT]).rows(i0, i1) if q is raw else q for m, raw, q in halves]

        self.expert_unit("w13", e, Role.W13_WEIGHT, [g.tensors[WEIGHT], u.tensors[WEIGHT]], emit, compute=True)

    def _w2_unit(self, e: int, d: Module) -> None:
        layout, h = self.pc.layout, self.h

        def emit(ctx: UnitContext, w2: np.ndarray, r: int, rows: tuple[int, int]) -> list:
            i0, i1 = rows
            whole = i1 - i0 == self.i
            if whole and not layout.shuffles_rows:  # source bytes: copied in the kernel
                return [ctx.src(d.tensors[WEIGHT])]
            part = w2 if whole else w2[:, i0:i1]
            return [np.ascontiguousarray(nvfp4.permute_rows(part, layout.w2_rows(h)))]

        self.expert_unit("w2", e, Role.W2_WEIGHT, [d.tensors[WEIGHT]], emit, checked_weight(d), compute=True)


class _Nvfp4Moe(_Moe):

    def plan(self) -> None:
        pc, layout, h = self.pc, self.pc.layout, self.h
        s2_1, s2_3, s2_2 = self.per_expert(WEIGHT_SCALE_2)
        w13_s2 = np.maximum(s2_1, s2_3)  # mocli policy: max, rescale the other half (SEMANTICS §7.1)
        mismatched = s2_1 != s2_3
        pc.plan.unified_scales["nvfp4_rescaled_experts"] += int(mismatched.sum())
        if bool(mismatched.any()):
            ratio = float((w13_s2 / np.minimum(s2_1, s2_3)).max())
            pc.plan.unified_scales["nvfp4_worst_scale_2_ratio"] = max(pc.plan.unified_scales["nvfp4_worst_scale_2_ratio"], ratio)
        a13, a2 = self.input_scales()
        e_count = self.e_count
        a13_v, a2_v = np.full(e_count, a13, dtype=F32), np.full(e_count, a2, dtype=F32)
        g1, g2 = w13_s2 * a13, s2_2 * a2
        a2_gscale = np.reciprocal(a2_v)
        for r in self.ranks:
            e, i = self.local(r), self.i_r(r)
            st = self.slice_transforms()
            gated, plain = layout.moe_row_transforms(True), layout.moe_row_transforms(False)
            self.add(r, Role.W13_WEIGHT, "U8", (e, 2 * i, h // 2), self.src("up", WEIGHT, r) + self.src("gate", WEIGHT, r),
                     ["stack_experts"] + st + ["rows_w3_w1"] + gated)
            self.add(r, Role.W13_WEIGHT_SCALE, "F8_E4M3", (e, *swizzled_shape(2 * i, h // 16)),
                     self.src("up", WEIGHT_SCALE, r) + self.src("gate", WEIGHT_SCALE, r),
                     ["stack_experts"] + st + ["rescale_to_max_scale_2", "rows_w3_w1"] + gated + ["swizzle_128x4"])
            self.add(r, Role.W2_WEIGHT, "U8", (e, h, i // 2), self.src("down", WEIGHT, r), ["stack_experts"] + st + plain)
            self.add(r, Role.W2_WEIGHT_SCALE, "F8_E4M3", (e, *swizzled_shape(h, i // 16)), self.src("down", WEIGHT_SCALE, r),
                     ["stack_experts"] + st + plain + ["swizzle_128x4"])
        vectors: dict[Role, tuple[np.ndarray, str, list[str]]] = {
            Role.W13_WEIGHT_SCALE_2: (w13_s2, "max(w1, w3) per expert", self.src("gate", WEIGHT_SCALE_2) + self.src("up", WEIGHT_SCALE_2)),
            Role.W2_WEIGHT_SCALE_2: (s2_2, "stack_experts", self.src("down", WEIGHT_SCALE_2)),
            Role.W13_INPUT_SCALE: (a13_v, "max over experts and halves, broadcast [E]",
                                   self.src("gate", INPUT_SCALE) + self.src("up", INPUT_SCALE)),
            Role.W2_INPUT_SCALE: (a2_v, "max over experts, broadcast [E]", self.src("down", INPUT_SCALE)),
            Role.G1_ALPHAS: (g1, "w13_weight_scale_2 * w13_input_scale", []),
            Role.G2_ALPHAS: (g2, "w2_weight_scale_2 * w2_input_scale", []),
            Role.A1_GSCALE: (np.reciprocal(a13_v), "1 / w13_input_scale", []),
            Role.A2_GSCALE: (a2_gscale, "1 / w2_input_scale", []),
        }
        vectors |= {role: (v, how, []) for role, (v, how) in layout.moe_extra_scales(self.kind, g1, g2, a2_gscale).items()}
        # Units in file order, one output tensor at a time (see _Fp8Moe.plan).
        for e, (g, u, _) in enumerate(self.mods):
            self._w13_unit(e, g, u)
        for e, (g, u, _) in enumerate(self.mods):
            self._w13_scale_unit(e, g, u, s2_1[e], s2_3[e], w13_s2[e])
        for e, (_, _, d) in enumerate(self.mods):
            self._w2_unit(e, d)
        for e, (_, _, d) in enumerate(self.mods):
            self._w2_scale_unit(e, d)
        self.plan_vectors(vectors)
        self._plan_pre_quant_scale()
        for r in self.ranks:
            self.module(r, {})

    def _plan_pre_quant_scale(self) -> None:
        """NVFP4_AWQ: the experts' one gate/up pre_quant_scale (validate holds them equal, AWQ001) as the
        layer's, [H] BF16 on every rank: the kernel scales the layer's input once (SEMANTICS §15.3)."""
        first = self.mods[0][0].tensors.get(PRE_QUANT_SCALE)
        if first is None:
            return
        sources = self.src("gate", PRE_QUANT_SCALE) + self.src("up", PRE_QUANT_SCALE)
        for r in self.ranks:
            self.add(r, Role.PRE_QUANT_SCALE, "BF16", (self.h,), sources, ["experts_equal", "to_bf16"])
        keys = [self.key(r, Role.PRE_QUANT_SCALE) for r in self.ranks]

        def run(ctx: UnitContext) -> list[Piece]:
            v = bf16_bytes(ctx.array(first), first.dtype).copy()
            return [Piece(k, 0, v) for k in keys]

        self.pc.plan.units.append(Unit(f"pqs:{self.p}", [first], keys, run, torch_free=True))

    # NVFP4 units: bytes copied in the kernel, or moved and rescaled in numpy (``mocli.ops``).

    def _w13_unit(self, e: int, g: Module, u: Module) -> None:
        layout = self.pc.layout

        def emit(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            i0, i1 = rows
            idx = layout.w13_rows(2 * (i1 - i0))
            if idx is None:  # [w3; w1] rows are source bytes: copied in the kernel, never read here
                return [ctx.src(u.tensors[WEIGHT]).rows(i0, i1), ctx.src(g.tensors[WEIGHT]).rows(i0, i1)]
            return [ctx.gather_array([(u.tensors[WEIGHT], i0, i1), (g.tensors[WEIGHT], i0, i1)], idx)]

        self.expert_unit("w13", e, Role.W13_WEIGHT, [g.tensors[WEIGHT], u.tensors[WEIGHT]], emit)

    def _w13_scale_unit(self, e: int, g: Module, u: Module, s2_1, s2_3, big) -> None:
        layout = self.pc.layout

        def prepare(ctx: UnitContext) -> tuple[np.ndarray, np.ndarray]:
            ub, gb = ctx.array(u.tensors[WEIGHT_SCALE]), ctx.array(g.tensors[WEIGHT_SCALE])
            for t, m in ((ub, u), (gb, g)):
                _check_bytes(t, m, WEIGHT_SCALE)
            return fp8.rescale_block_scales(ub, s2_3, big), fp8.rescale_block_scales(gb, s2_1, big)

        def emit(ctx: UnitContext, scales, r: int, rows: tuple[int, int]) -> list[np.ndarray]:
            (ub, gb), (i0, i1) = scales, rows
            bs13 = nvfp4.permute_rows(np.concatenate([ub[i0:i1], gb[i0:i1]]), layout.w13_rows(2 * (i1 - i0)))
            return [nvfp4.swizzle_block_scales(bs13)]

        self.expert_unit("w13s", e, Role.W13_WEIGHT_SCALE, [g.tensors[WEIGHT_SCALE], u.tensors[WEIGHT_SCALE]],
                         emit, prepare)

    def _w2_unit(self, e: int, d: Module) -> None:
        layout, h = self.pc.layout, self.h

        def emit(ctx: UnitContext, loaded: dict, r: int, rows: tuple[int, int]) -> list:
            i0, i1 = rows
            if not layout.shuffles_rows and i1 - i0 == self.i:  # source bytes: copied in the kernel, never read
                return [ctx.src(d.tensors[WEIGHT])]
            if "w2" not in loaded:
                loaded["w2"] = ctx.array(d.tensors[WEIGHT])
            part = loaded["w2"][:, i0 // 2:i1 // 2]
            return [np.ascontiguousarray(nvfp4.permute_rows(part, layout.w2_rows(h)))]

        self.expert_unit("w2", e, Role.W2_WEIGHT, [d.tensors[WEIGHT]], emit, lambda ctx: {})

    def _w2_scale_unit(self, e: int, d: Module) -> None:
        layout, h = self.pc.layout, self.h

        def prepare(ctx: UnitContext) -> np.ndarray:
            db = ctx.array(d.tensors[WEIGHT_SCALE])
            _check_bytes(db, d, WEIGHT_SCALE)
            return db

        def emit(ctx: UnitContext, db: np.ndarray, r: int, rows: tuple[int, int]) -> list[np.ndarray]:
            i0, i1 = rows
            return [nvfp4.swizzle_block_scales(nvfp4.permute_rows(db[:, i0 // 16:i1 // 16], layout.w2_rows(h)))]

        self.expert_unit("w2s", e, Role.W2_WEIGHT_SCALE, [d.tensors[WEIGHT_SCALE]], emit, prepare)
