"""MXFP8 linears (SEMANTICS §14.2) and flashinfer-trtllm's MXFP8 experts (§14.3): e4m3 weights kept, their E8M0 block scales (one per 32 values along
K) swizzled 128x4 per rank. flashinfer-cutlass keeps the weight as it is (copied in the kernel where a
rank takes whole rows); flashinfer-trtllm pads the rows to 128 and shuffles them in 32-row blocks, its
scales' padding rows byte 0 (2^-127) as vLLM writes them. No global or input scale: activations are
quantized at run time. Fused shards concatenate on N (no scale to unify)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.io.safetensors_file import TensorEntry
from mocli.kinds import Role
from mocli.ops import nvfp4, roundup, swizzled_shape
from mocli.parallel import RankSlice
from mocli.plan.dense import _Dense, check_fp8
from mocli.plan.moe import _Moe
from mocli.schemes.mxfp8 import BLOCK
from mocli.stream.units import BadData, Piece, SourceRange, concat_pieces
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets.base import ROW_SHUFFLE

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext

E8M0_NAN = 0xFF


class _Mxfp8Dense(_Dense):
    compute = True  # every weight byte is checked for NaN codes

    def plan(self) -> None:
        layout, shards = self.pc.layout, self.shards
        weights, scales = [m.tensors[WEIGHT] for m in shards], [m.tensors[WEIGHT_SCALE] for m in shards]
        padded = {}
        for r in self.ranks:
            sl = self.slice_of(r)
            padded[r] = roundup(sl.n, 128) if layout.shuffles_rows else sl.n
            rows = self.fused + self.slice_transforms() + (["pad_rows_128", ROW_SHUFFLE] if layout.shuffles_rows else [])
            self.add(r, Role.WEIGHT, "F8_E4M3", (padded[r], sl.k), [w.name for w in weights], rows)
            self.add(r, Role.WEIGHT_SCALE, "U8", swizzled_shape(padded[r], sl.k // BLOCK), [s.name for s in scales],
                     rows + ["swizzle_128x4"])

        def run(ctx: UnitContext) -> list[Piece]:
            for w in weights:
                check_fp8(ctx.array(w), w)
            sc = [_checked_scales(ctx, s) for s in scales]
            pieces: list[Piece] = []
            for t, sl in self.slices.items():
                ranks = [r for r in self.ranks if self.pc.parallel.tp_rank(r) == t]
                wparts, swz = self._rank_weight(ctx, sl, padded[ranks[0]], weights), self._rank_scales(sc, sl, padded[ranks[0]])
                for r in ranks:
                    pieces += concat_pieces(self.key(r, Role.WEIGHT), wparts)
                    pieces.append(Piece(self.key(r, Role.WEIGHT_SCALE), 0, swz))
            return pieces + self.bias_pieces(ctx)

        self.finish(lambda r: {"padded_n": padded[r]}, weights + scales, run)

    def _rank_weight(self, ctx: UnitContext, sl: RankSlice, np_: int, weights: list[TensorEntry]) -> list:
        """The rank's weight: its source rows copied in the kernel where nothing moves them, else its rows
        (and columns) gathered, padded to ``np_`` rows and shuffled."""
        (c0, c1), idx = sl.cols, self.pc.layout.nvfp4_weight_rows(np_)
        if idx is None and (c0, c1) == (0, self.k_full):
            return [SourceRange(w, 0, w.nbytes).rows(a, b) for w, (a, b) in zip(weights, sl.rows, strict=True)]
        rank_w = np.concatenate([ctx.array(w)[a:b, c0:c1] for w, (a, b) in zip(weights, sl.rows, strict=True)])
        return [np.ascontiguousarray(nvfp4.permute_rows(nvfp4.pad_2d(rank_w, np_, c1 - c0), idx))]

    def _rank_scales(self, sc: list[np.ndarray], sl: RankSlice, np_: int) -> np.ndarray:
        (c0, c1), idx = sl.cols, self.pc.layout.nvfp4_weight_rows(np_)
        rank_s = np.concatenate([x[a:b, c0 // BLOCK:c1 // BLOCK] for x, (a, b) in zip(sc, sl.rows, strict=True)])
        return nvfp4.swizzle_block_scales(nvfp4.permute_rows(nvfp4.pad_2d(rank_s, np_, rank_s.shape[1]), idx))


def _checked_scales(ctx: UnitContext, entry: TensorEntry) -> np.ndarray:
    raw = ctx.array(entry)
    _check_e8m0(raw, entry)
    return raw


SCALE_ONE = 127  # E8M0 2^0: what trtllm's MXFP8 MoE preparation fills its padded scales with (SEMANTICS §14.3)


class _Mxfp8Moe(_Moe):
    """flashinfer-trtllm MXFP8 experts (SEMANTICS §14.3), per rank: I padded to Ip = roundup(I, 128) and H to
    Hp = roundup(H, 256) (weights zero, scales 127), fc1 rows [w3; w1], the gated interleave and the 32-row
    shuffle (fc2: the shuffle), scales with their rows, then 128x4-interleaved per expert."""

    def plan(self) -> None:
        h, layout = self.h, self.pc.layout
        self.hp = roundup(h, 256)
        self.ip = {r: roundup(self.i_r(r), 128) for r in self.ranks}
        for r in self.ranks:
            e, ip, st = self.local(r), self.ip[r], ["stack_experts"] + self.slice_transforms()
            gated, plain = layout.moe_row_transforms(True), layout.moe_row_transforms(False)
            self.add(r, Role.W13_WEIGHT, "F8_E4M3", (e, 2 * ip, self.hp), self.src("up", WEIGHT, r) + self.src("gate", WEIGHT, r),
                     st + ["pad_to_Ip_Hp", "rows_w3_w1"] + gated)
            self.add(r, Role.W13_WEIGHT_SCALE, "U8", (e, 2 * ip, self.hp // BLOCK),
                     self.src("up", WEIGHT_SCALE, r) + self.src("gate", WEIGHT_SCALE, r),
                     st + ["pad_to_Ip_Hp_127", "rows_w3_w1"] + gated + ["swizzle_128x4"])
            self.add(r, Role.W2_WEIGHT, "F8_E4M3", (e, self.hp, ip), self.src("down", WEIGHT, r), st + ["pad_to_Hp_Ip"] + plain)
            self.add(r, Role.W2_WEIGHT_SCALE, "U8", (e, self.hp, ip // BLOCK), self.src("down", WEIGHT_SCALE, r),
                     st + ["pad_to_Hp_Ip_127"] + plain + ["swizzle_128x4"])
        for e, (g, u, _) in enumerate(self.mods):
            self._w13_units(e, g, u)
        for e, (_, _, d) in enumerate(self.mods):
            self._w2_units(e, d)
        for r in self.ranks:
            self.module(r, {"padded_intermediate": self.ip[r], "padded_hidden": self.hp})

    def _w13_units(self, e: int, g, u) -> None:
        layout, h = self.pc.layout, self.h

        def halves(ctx: UnitContext, r: int, rows: tuple[int, int], role: str, fill: int, width: int, cols: int):
            (i0, i1), ip = rows, self.ip[r]
            out = np.full((2 * ip, width), fill, dtype=np.uint8)
            for half, m in enumerate((u, g)):  # [w3; w1]: FlashInfer's act(second half) * first half
                raw = ctx.array(m.tensors[role])
                (check_fp8 if role == WEIGHT else _check_e8m0)(raw, m.tensors[role])
                out[ip * half:ip * half + i1 - i0, :cols] = raw[i0:i1].view(np.uint8)
            return nvfp4.permute_rows(out, layout.w13_rows(2 * ip))

        def weights(ctx: UnitContext, _, r: int, rows) -> list:
            return [halves(ctx, r, rows, WEIGHT, 0, self.hp, h)]

        def scales(ctx: UnitContext, _, r: int, rows) -> list:
            return [nvfp4.swizzle_block_scales(halves(ctx, r, rows, WEIGHT_SCALE, SCALE_ONE, self.hp // BLOCK, h // BLOCK))]

        self.expert_unit("w13", e, Role.W13_WEIGHT, [g.tensors[WEIGHT], u.tensors[WEIGHT]], weights, compute=True)
        self.expert_unit("w13s", e, Role.W13_WEIGHT_SCALE, [g.tensors[WEIGHT_SCALE], u.tensors[WEIGHT_SCALE]], scales)

    def _w2_units(self, e: int, d) -> None:
        layout, h = self.pc.layout, self.h

        def padded(ctx: UnitContext, r: int, rows, role: str, fill: int, per: int) -> np.ndarray:
            (i0, i1), ip = rows, self.ip[r]
            raw = ctx.array(d.tensors[role])
            (check_fp8 if role == WEIGHT else _check_e8m0)(raw, d.tensors[role])
            out = np.full((self.hp, ip // per), fill, dtype=np.uint8)
            out[:h, :(i1 - i0) // per] = raw[:, i0 // per:i1 // per].view(np.uint8)
            return nvfp4.permute_rows(out, layout.w2_rows(self.hp))

        def weights(ctx: UnitContext, _, r: int, rows) -> list:
            return [padded(ctx, r, rows, WEIGHT, 0, 1)]

        def scales(ctx: UnitContext, _, r: int, rows) -> list:
            return [nvfp4.swizzle_block_scales(padded(ctx, r, rows, WEIGHT_SCALE, SCALE_ONE, BLOCK))]

        self.expert_unit("w2", e, Role.W2_WEIGHT, [d.tensors[WEIGHT]], weights, compute=True)
        self.expert_unit("w2s", e, Role.W2_WEIGHT_SCALE, [d.tensors[WEIGHT_SCALE]], scales)


def _check_e8m0(raw: np.ndarray, entry: TensorEntry) -> None:
    if bool((raw == E8M0_NAN).any()):
        raise BadData(entry.name, "E8M0 scale bytes encode NaN (0xFF)")
