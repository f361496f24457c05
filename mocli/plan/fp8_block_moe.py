"""FP8 128x128-block experts (SEMANTICS §18.2): vLLM 0.33's ``prepare_fp8_moe_layer_for_fi`` per rank.

w13 rows [w3; w1] for the weights and their block scales; no padding (the rank's I % 128 and H % 128 are
validated first, TGT001); block scales float32, clamped to at least 1e-10 (the engine's guard for FlashInfer
CUTLASS on Hopper); flashinfer-trtllm's weights also shuffled in 16-row blocks and laid out BlockMajorK
(``TargetLayout.block_moe_*``). No alphas, no input scales: activations are quantized per token and group of
128 at run time. A rank holds whole 128-blocks of its experts' I (intermediate slicing) or whole experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.census import Module
from mocli.kinds import Role
from mocli.plan.core import F32
from mocli.plan.moe import _check_bytes, _Moe, checked_weight
from mocli.tables import WEIGHT, WEIGHT_SCALE

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext

BLOCK = 128
MIN_BLOCK_SCALE = np.float32(1e-10)  # flashinfer_utils.prepare_fp8_moe_layer_for_fi: _FI_CUTLASS_MIN_BLOCK_SCALE


class _Fp8BlockMoe(_Moe):
    STEPS: list[str] = []  # transforms after the slice ones, on every tensor
    SCALE_STEPS = ["clamp_min_1e-10"]

    def w13_sources(self, r: int, name: str) -> list[str]:
        """The source tensors the rank's w13 tensor of ``name`` (weight, weight_scale) is made from."""
        return self.src("up", name, r) + self.src("gate", name, r)

    def w2_sources(self, r: int, name: str) -> list[str]:
        return self.src("down", name, r)

    def meta(self) -> dict:
        return {"block": [BLOCK, BLOCK]}

    def plan(self) -> None:
        h, lay = self.h, self.pc.layout
        for r in self.ranks:
            e, i, st = self.local(r), self.i_r(r), ["stack_experts"] + self.slice_transforms() + self.STEPS
            self.add(r, Role.W13_WEIGHT, "F8_E4M3", (e, *lay.block_moe_shape(2 * i, h)), self.w13_sources(r, WEIGHT),
                     st + ["rows_w3_w1"] + lay.block_moe_transforms())
            self.add(r, Role.W2_WEIGHT, "F8_E4M3", (e, *lay.block_moe_shape(h, i)), self.w2_sources(r, WEIGHT),
                     st + lay.block_moe_transforms())
            self.add(r, Role.W13_WEIGHT_SCALE, "F32", (e, 2 * i // BLOCK, h // BLOCK), self.w13_sources(r, WEIGHT_SCALE),
                     st + ["rows_w3_w1"] + self.SCALE_STEPS)
            self.add(r, Role.W2_WEIGHT_SCALE, "F32", (e, h // BLOCK, i // BLOCK), self.w2_sources(r, WEIGHT_SCALE),
                     st + self.SCALE_STEPS)
        for e, (g, u, _) in enumerate(self.mods):
            self._w13_unit(e, g, u)
        for e, (_, _, d) in enumerate(self.mods):
            self._w2_unit(e, d)
        for e in range(self.e_count):
            self._scale_unit(e)
        for r in self.ranks:
            self.module(r, self.meta())

    def _w13_unit(self, e: int, g: Module, u: Module) -> None:
        lay = self.pc.layout

        def emit(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            i0, i1 = rows
            halves = []
            for m in (u, g):  # [w3; w1]: FlashInfer computes act(second half) * first half
                raw = ctx.array(m.tensors[WEIGHT], i0, i1)  # mapped, not read (UnitContext.array)
                _check_bytes(raw, m, WEIGHT)
                halves.append(raw)
            if not lay.block_moe_transforms():  # source bytes: copied in the kernel
                return [ctx.src(m.tensors[WEIGHT]).rows(i0, i1) for m in (u, g)]
            return [np.ascontiguousarray(lay.block_moe_weight(np.concatenate(halves)))]

        self.expert_unit("w13", e, Role.W13_WEIGHT, [g.tensors[WEIGHT], u.tensors[WEIGHT]], emit, compute=True)

    def _w2_unit(self, e: int, d: Module) -> None:
        lay = self.pc.layout

        def emit(ctx: UnitContext, w2: np.ndarray, r: int, rows: tuple[int, int]) -> list:
            i0, i1 = rows
            if i1 - i0 == self.i and not lay.block_moe_transforms():
                return [ctx.src(d.tensors[WEIGHT])]
            return [np.ascontiguousarray(lay.block_moe_weight(np.ascontiguousarray(w2[:, i0:i1])))]

        self.expert_unit("w2", e, Role.W2_WEIGHT, [d.tensors[WEIGHT]], emit, checked_weight(d), compute=True)

    def _scale_unit(self, e: int) -> None:
        """An expert's block scales on every rank that holds it: float32 (as read, ``mocli.scales``), the
        rank's block rows of I (w13) or columns (w2), clamped."""
        g, u, d = self.mods[e]
        scale = lambda m: self.pc.scales[m.tensors[WEIGHT_SCALE].name].reshape(-1, m.tensors[WEIGHT_SCALE].shape[-1])  # noqa: E731

        def w13(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            b0, b1 = rows[0] // BLOCK, rows[1] // BLOCK
            return [_clamped(np.concatenate([scale(u)[b0:b1], scale(g)[b0:b1]]))]

        def w2(ctx: UnitContext, _, r: int, rows: tuple[int, int]) -> list:
            return [_clamped(scale(d)[:, rows[0] // BLOCK:rows[1] // BLOCK])]

        self.expert_unit("w13s", e, Role.W13_WEIGHT_SCALE, [], w13)
        self.expert_unit("w2s", e, Role.W2_WEIGHT_SCALE, [], w2)


def _clamped(s: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.maximum(s.astype(F32), MIN_BLOCK_SCALE))
