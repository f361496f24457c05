"""Dense linears: fused shards, per-rank slices, and each target's layout (SEMANTICS §3, §6, §8, §10).

One unit per module reads every source shard once and writes every rank's tensors. Ranks that
share a tensor-parallel rank (expert-parallel replicas) get identical bytes, computed once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.census import Module
from mocli.io.safetensors_file import TensorEntry
from mocli.kinds import ModuleKind, Role
from mocli.ops import bf16_bytes, fp8, nvfp4, swizzled_shape
from mocli.parallel import RankSlice, Split, rank_slices, split_of
from mocli.plan.context import PlanContext
from mocli.plan.core import F32, ConvertedModule
from mocli.stream.units import BadData, OutTensor, Piece, SourceRange, Unit, concat_pieces
from mocli.tables import INPUT_SCALE, PRE_QUANT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets.base import ROW_SHUFFLE

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext

class _Dense:
    """One dense module (a fused group or a lone linear), every rank: per-rank output tensors,
    manifest modules and the one unit. Subclasses plan their kinds; ``plan()`` adds them."""

    compute = False  # whether the unit reads every weight byte (``Unit.compute``)

    def __init__(self, pc: PlanContext, kind: ModuleKind, prefix: str, shards: list[Module]) -> None:
        pc.consume(shards)
        self.pc, self.kind, self.prefix, self.shards = pc, kind, prefix, shards
        self.slices: dict[int, RankSlice] = rank_slices(pc.parallel, pc.heads, shards)
        self.split = split_of(shards[0].name) if pc.parallel.tp > 1 else Split.REPLICATED
        self.fused = ["concat_rows"] if len(shards) > 1 else []
        self.n_full = sum(m.out_in[0] for m in shards)
        self.k_full = shards[0].out_in[1]
        self.ranks = range(pc.parallel.ranks)
        self.tensors: dict[int, dict[str, str]] = {r: {} for r in self.ranks}
        self.outputs: list = []

    def slice_of(self, rank: int) -> RankSlice:
        return self.slices[self.pc.parallel.tp_rank(rank)]

    def slice_transforms(self) -> list[str]:
        if self.pc.parallel.single or self.split is Split.REPLICATED:
            return []
        return [f"{self.split}_parallel_slice"]

    def add(self, rank: int, role: Role, dtype: str, shape: tuple[int, ...], sources: list[str],
            transforms: list[str]) -> None:
        t = OutTensor(f"{self.prefix}.{role}", dtype, shape, str(role), sources, transforms,
                      self.pc.parallel.group(rank))
        self.tensors[rank][str(role)] = self.pc.plan.add(t)
        self.outputs.append(t.key)

    def key(self, rank: int, role: Role) -> tuple[str, str]:
        return self.pc.parallel.group(rank), f"{self.prefix}.{role}"

    def sources(self, suffix: str) -> list[str]:
        return [m.tensors[suffix].name for m in self.shards]

    def finish(self, meta_extra, inputs: list[TensorEntry], run, parts: tuple[Unit, ...] = ()) -> None:
        """The manifest's modules and the unit (after ``parts``: units that make a piece of the outputs
        each, ahead of it)."""
        for r in self.ranks:
            s = self.slice_of(r)
            meta = {"n": s.n, "k": s.k, "shard_rows": [b - a for a, b in s.rows], **meta_extra(r)}
            if not self.pc.parallel.single:
                meta |= {"split": str(self.split), "tp_rank": s.tp_rank, "slices": s.meta(),
                         "full": {"n": self.n_full, "k": self.k_full}}
            self.pc.plan.modules.append(ConvertedModule(self.prefix, str(self.kind), str(self.shards[0].scheme),
                                                        self.tensors[r], [m.name for m in self.shards], meta,
                                                        self.pc.parallel.group(r)))
        self._plan_bias()
        self.pc.plan.units += parts
        theirs = {k for p in parts for k in p.outputs}
        self.pc.plan.units.append(Unit(f"dense:{self.prefix}", inputs + self._bias_entries(),
                                       [k for k in self.outputs if k not in theirs], run, self.compute, torch_free=True))

    # A bias is sliced with the rows of a column-parallel layer, whole elsewhere (the engine adds a
    # row-parallel bias once, after the all-reduce).
    def _bias_entries(self) -> list[TensorEntry]:
        biases = [m.tensors.get("bias") for m in self.shards]
        if not any(b is not None for b in biases):
            return []
        if not all(b is not None for b in biases):
            raise ValueError(f"{self.prefix}: some shards have a bias and some do not")
        return biases

    def _plan_bias(self) -> None:
        biases = self._bias_entries()
        if not biases:
            return
        for r in self.ranks:
            s = self.slice_of(r)
            self.add(r, Role.BIAS, biases[0].dtype, (s.n,), [b.name for b in biases],
                     self.fused + self.slice_transforms())
            for m in self.pc.plan.modules[-len(self.ranks):]:
                if m.group == self.pc.parallel.group(r):
                    m.tensors[str(Role.BIAS)] = f"{self.prefix}.{Role.BIAS}"

    def bias_pieces(self, ctx: UnitContext) -> list[Piece]:
        biases = self._bias_entries()
        if not biases:
            return []
        whole = [ctx.array(b) for b in biases]  # bytes, one row per element: no torch needed
        pieces = []
        for r in self.ranks:
            s = self.slice_of(r)
            pieces += concat_pieces(self.key(r, Role.BIAS), [w[a:b] for w, (a, b) in zip(whole, s.rows, strict=True)])
        return pieces


def check_fp8(raw: np.ndarray, entry: TensorEntry) -> None:
    if fp8.has_nan_fp8(raw):
        raise BadData(entry.name, "FP8 bytes encode NaN (0x7F or 0xFF)")


def _weight_pieces(dense: _Dense, ctx: UnitContext, whole: list[np.ndarray | None],
                   weights: list[TensorEntry]) -> list[Piece]:
    """Every rank's slice of the (fused) FP8 weight: its rows of each shard, its columns, concatenated.
    A shard kept as it is (``None`` in ``whole``) is copied in the kernel where a rank takes whole rows."""
    pieces = []
    for r in dense.ranks:
        sl = dense.slice_of(r)
        c0, c1 = sl.cols
        parts: list = []
        for q, w, (a, b) in zip(whole, weights, sl.rows, strict=True):
            if (c0, c1) == (0, dense.k_full):
                parts.append(SourceRange(w, 0, w.nbytes).rows(a, b) if q is None else q[a:b])
            else:
                parts.append(np.ascontiguousarray((ctx.array(w) if q is None else q)[a:b, c0:c1]))
        pieces += concat_pieces(dense.key(r, Role.WEIGHT), parts)
    return pieces


class _Fp8TensorDense(_Dense):
    """FP8 per-tensor: shards requantized to the max weight scale, max input scale (SEMANTICS §3). In
    numpy: every byte checked for NaN codes, the shards below the max scale requantized through a
    256-entry table, the max-scale shard copied in the kernel (``mocli.ops.fp8``)."""

    compute = True

    def plan(self) -> None:
        pc, shards = self.pc, self.shards
        weights = [m.tensors[WEIGHT] for m in shards]
        s = [pc.scale(m, WEIGHT_SCALE) for m in shards]
        big_s = np.stack(s).max()
        big_a = np.stack([pc.scale(m, INPUT_SCALE) for m in shards]).max()
        f16 = pc.census.spelling.fp8_requant_f16
        requant = [f16 or bool(si != big_s) for si in s]
        pc.plan.unified_scales["fp8_requantized_shards"] += sum(bool(si != big_s) for si in s)
        for r in self.ranks:
            sl = self.slice_of(r)
            self.add(r, Role.WEIGHT, "F8_E4M3", (sl.n, sl.k), [w.name for w in weights],
                     self.fused + self.slice_transforms()
                     + ([("requantize_max_scale_f16" if f16 else "requantize_max_scale")] if any(requant) else []))
            self.add(r, Role.WEIGHT_SCALE, "F32", (), self.sources(WEIGHT_SCALE), ["max"] if self.fused else [])
            self.add(r, Role.INPUT_SCALE, "F32", (), self.sources(INPUT_SCALE), ["max"] if self.fused else [])
        values = {(r, role): pc.plan.computed_value(self.key(r, role), v) for r in self.ranks
                  for role, v in ((Role.WEIGHT_SCALE, big_s), (Role.INPUT_SCALE, big_a))}

        def run(ctx: UnitContext) -> list[Piece]:
            whole: list[np.ndarray | None] = []
            for w, si, rq in zip(weights, s, requant, strict=True):
                raw = ctx.array(w)
                check_fp8(raw, w)
                whole.append(fp8.requantize_fp8(raw, si, big_s, f16) if rq else None)
            pieces = _weight_pieces(self, ctx, whole, weights)
            pieces += [Piece(self.key(r, role), 0, v.reshape(())) for (r, role), v in values.items()]
            return pieces + self.bias_pieces(ctx)

        self.finish(lambda r: {}, weights, run)


class _Fp8ScaledDense(_Dense):
    """FP8 per-channel ([N] scales) and 128x128 blocks ([N/128, K/128]): bytes kept (checked for NaN
    codes, copied in the kernel where a rank takes whole rows), scales sliced with their rows
    (SEMANTICS §8, §10)."""

    compute = True  # every weight byte is checked for NaN codes

    def plan(self) -> None:
        pc, shards = self.pc, self.shards
        weights = [m.tensors[WEIGHT] for m in shards]
        scale_entries = [m.tensors[WEIGHT_SCALE] for m in shards]
        block = self.kind is ModuleKind.FP8_BLOCK_LINEAR
        for r in self.ranks:
            sl = self.slice_of(r)
            sshape = (sl.n // 128, sl.k // 128) if block else (sl.n,)
            self.add(r, Role.WEIGHT, "F8_E4M3", (sl.n, sl.k), [w.name for w in weights],
                     self.fused + self.slice_transforms())
            self.add(r, Role.WEIGHT_SCALE, "F32", sshape, [e.name for e in scale_entries],
                     self.fused + self.slice_transforms() + (["reshape_blocks"] if block else []))
        # FP8_PB_WO [N/128, 1, K/128, 1] -> [N/128, K/128] (SEMANTICS §8); per-channel [N] or [N, 1] -> [N]
        sc = [np.asarray(pc.scales[e.name], dtype=F32).reshape(-1, self.k_full // 128) if block
              else np.asarray(pc.scales[e.name], dtype=F32).reshape(-1) for e in scale_entries]

        def run(ctx: UnitContext) -> list[Piece]:
            for w in weights:
                check_fp8(ctx.array(w), w)
            pieces = _weight_pieces(self, ctx, [None] * len(weights), weights)
            for r in self.ranks:
                pieces += concat_pieces(self.key(r, Role.WEIGHT_SCALE), self._rank_scales(sc, r, block))
            return pieces + self.bias_pieces(ctx)

        self.finish(lambda r: {}, weights, run)

    def _rank_scales(self, sc: list[np.ndarray], r: int, block: bool) -> list[np.ndarray]:
        sl = self.slice_of(r)
        if block:
            c0, c1 = sl.cols[0] // 128, sl.cols[1] // 128
            return [np.ascontiguousarray(x[a // 128:b // 128, c0:c1]) for x, (a, b) in zip(sc, sl.rows, strict=True)]
        if self.split is Split.ROW:
            return [x.copy() for x in sc]  # per-channel scales follow output rows: whole on row-parallel ranks
        return [x[a:b].copy() for x, (a, b) in zip(sc, sl.rows, strict=True)]


class _Nvfp4Dense(_Dense):
    """NVFP4: block scales rescaled to the max weight_scale_2, then the target's weight layout and
    128x4 swizzle per rank; alpha and 1/input_scale precomputed (SEMANTICS §6). Bytes moved (and
    scales rescaled) in numpy on the CPU, without torch (``mocli.ops.nvfp4``)."""

    def plan(self) -> None:
        pc, shards, layout = self.pc, self.shards, self.pc.layout
        s2 = [pc.scale(m, WEIGHT_SCALE_2) for m in shards]
        big_s2 = self._unify(s2)
        big_a = np.stack([pc.scale(m, INPUT_SCALE) for m in shards]).max()
        weights = [m.tensors[WEIGHT] for m in shards]
        bscales = [m.tensors[WEIGHT_SCALE] for m in shards]
        shapes = {}
        for r in self.ranks:
            sl = self.slice_of(r)
            n, k = sl.n, sl.k
            shapes[r] = layout.nvfp4_weight_shape(n, k)
            rows = self.slice_transforms()
            self.add(r, Role.WEIGHT, "U8", shapes[r], [w.name for w in weights],
                     self.fused + rows + layout.nvfp4_weight_transforms(n, k))
            strans = (self.fused + rows + (["rescale_to_max_scale_2"] if any(x != big_s2 for x in s2) else [])
                      + ([ROW_SHUFFLE] if layout.shuffles_rows else []) + ["swizzle_128x4"])
            self.add(r, Role.WEIGHT_SCALE, "F8_E4M3", swizzled_shape(n, k // 16), [b.name for b in bscales], strans)
            self.add(r, Role.WEIGHT_SCALE_2, "F32", (), self.sources(WEIGHT_SCALE_2), ["max"])
            self.add(r, Role.INPUT_SCALE, "F32", (), self.sources(INPUT_SCALE), ["max"])
            self.add(r, Role.ALPHA, "F32", (), [], ["input_scale * weight_scale_2"])
            self.add(r, Role.INPUT_SCALE_INV, "F32", (), [], ["1 / input_scale"])
        scalars = {Role.WEIGHT_SCALE_2: big_s2, Role.INPUT_SCALE: big_a, Role.ALPHA: big_a * big_s2,
                   Role.INPUT_SCALE_INV: pc.inverse_of_max(shards, INPUT_SCALE)}
        values = {(r, role): pc.plan.computed_value(self.key(r, role), v) for r in self.ranks for role, v in scalars.items()}
        pqs = self._plan_pre_quant_scale()

        def run(ctx: UnitContext) -> list[Piece]:
            pieces: list[Piece] = []
            loaded: dict[int, np.ndarray] = {}  # shard -> packed weight, read only when a rank needs the bytes
            bs = []
            for b, si in zip(bscales, s2, strict=True):
                raw = ctx.array(b)
                check_fp8(raw, b)
                bs.append(fp8.rescale_block_scales(raw, si, big_s2))
            for t, sl in self.slices.items():
                ranks = [r for r in self.ranks if self.pc.parallel.tp_rank(r) == t]
                wparts = self._rank_weight(ctx, sl, shapes[ranks[0]], weights, loaded)
                c0, c1 = sl.cols
                rank_bs = np.concatenate([x[a:bnd, c0 // 16:c1 // 16] for x, (a, bnd) in zip(bs, sl.rows, strict=True)])
                swz = nvfp4.swizzle_block_scales(nvfp4.permute_rows(rank_bs, layout.nvfp4_weight_rows(sl.n)))
                for r in ranks:
                    pieces += concat_pieces(self.key(r, Role.WEIGHT), wparts)
                    pieces.append(Piece(self.key(r, Role.WEIGHT_SCALE), 0, swz))
                    pieces += [Piece(self.key(r, role), 0, values[r, role].reshape(())) for role in scalars]
                    if pqs is not None:
                        pieces.append(Piece(self.key(r, Role.PRE_QUANT_SCALE), 0,
                                            bf16_bytes(ctx.array(pqs)[c0:c1], pqs.dtype).copy()))
            return pieces + self.bias_pieces(ctx)

        self.finish(lambda r: {"padded_n": shapes[r][0], "padded_k": shapes[r][1] * 2},
                    weights + bscales + ([pqs] if pqs is not None else []), run)

    def _plan_pre_quant_scale(self) -> TensorEntry | None:
        """NVFP4_AWQ: the shards' one pre_quant_scale (validate holds them equal, AWQ001) per rank, its K
        columns of the rank, in BF16 (SEMANTICS §15.3). None where the source folded it away."""
        entry = self.shards[0].tensors.get(PRE_QUANT_SCALE)
        if entry is not None:
            for r in self.ranks:
                sl = self.slice_of(r)
                self.add(r, Role.PRE_QUANT_SCALE, "BF16", (sl.k,), self.sources(PRE_QUANT_SCALE),
                         (["shards_equal"] if self.fused else []) + self.slice_transforms() + ["to_bf16"])
        return entry

    def _copied(self, sl: RankSlice, wshape: tuple[int, int]) -> bool:
        """Whether the rank's weight is its source rows as they are (copied in the kernel)."""
        return wshape == (sl.n, sl.k // 2) and not self.pc.layout.shuffles_rows \
            and tuple(sl.cols) == (0, self.k_full)

    def _unify(self, s2: list[np.ndarray]) -> np.float32:
        """S2 = max over the shards (mocli policy, SEMANTICS §6); the shards below it are counted."""
        big = np.stack(s2).max()
        rescaled = sum(bool(x != big) for x in s2)
        counts = self.pc.plan.unified_scales
        counts["nvfp4_rescaled_shards"] += rescaled
        if rescaled:
            counts["nvfp4_worst_scale_2_ratio"] = max(counts["nvfp4_worst_scale_2_ratio"], float(big / np.stack(s2).min()))
        return big

    def _rank_weight(self, ctx: UnitContext, sl: RankSlice, wshape: tuple[int, int], weights: list[TensorEntry],
                     loaded: dict[int, np.ndarray]) -> list:
        """One tp rank's packed weight in the target layout: source bytes the kernel copies when no
        transform touches them, else its rows and columns permuted and padded here."""
        c0, c1 = sl.cols
        if self._copied(sl, wshape):
            return [SourceRange(w, 0, w.nbytes).rows(a, b) for w, (a, b) in zip(weights, sl.rows, strict=True)]
        parts = []
        for i, (a, b) in enumerate(sl.rows):
            if i not in loaded:
                loaded[i] = ctx.array(weights[i])
            parts.append(loaded[i][a:b, c0 // 2:c1 // 2])
        rank_w = nvfp4.permute_rows(np.concatenate(parts), self.pc.layout.nvfp4_weight_rows(sl.n))
        return [np.ascontiguousarray(nvfp4.pad_2d(rank_w, *wshape))]
