"""MXFP8 linears (SEMANTICS §14.2): e4m3 weights kept, their E8M0 block scales (one per 32 values along
K) swizzled 128x4 per rank. flashinfer-cutlass keeps the weight as it is (copied in the kernel where a
rank takes whole rows); flashinfer-trtllm pads the rows to 128 and shuffles them in 32-row blocks, its
scales' padding rows byte 0 (2^-127) as vLLM writes them. No global or input scale: activations are
quantized at run time. Fused shards concatenate on N (no scale to unify)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.engine.units import BadData, Piece, SourceRange, concat_pieces
from mocli.io.safetensors_file import TensorEntry
from mocli.kinds import ModuleKind, Role
from mocli.ops import nvfp4, roundup, swizzled_shape
from mocli.parallel import RankSlice
from mocli.plan.dense import _Dense, check_fp8
from mocli.schemes.mxfp8 import BLOCK
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets.base import ROW_SHUFFLE

if TYPE_CHECKING:
    from mocli.engine.pool import UnitContext

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
    if bool((raw == E8M0_NAN).any()):
        raise BadData(entry.name, "E8M0 scale bytes encode NaN (0xFF)")
    return raw


MXFP8_PLANNERS = {ModuleKind.MXFP8_LINEAR: _Mxfp8Dense}
