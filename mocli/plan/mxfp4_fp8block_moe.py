"""MXFP4 experts written as FP8 128x128-block experts (``fp8_block_moe``, SEMANTICS §18.2) by the lossless
re-encoding of §19.7 (``convert --mxfp4-experts fp8-block``; ``mocli.targets.experts``).

Each expert matrix (up, gate [I, H]; down [H, I]) is re-encoded whole by ``mocli.plan.mxfp4_fp8block``: e4m3
codes and one power-of-two float32 scale per 128x128 block. A rank's rows of I (w13) or columns (w2) start on a
multiple of 128 (§18.3, TGT001 otherwise), so the rank's blocks are whole blocks of the expert's grid and the
[w3; w1] halves never share one. Then everything as ``_Fp8BlockMoe`` lays it out: rows [w3; w1], flashinfer-trtllm's
16-row shuffle and BlockMajorK. The scales are at least 2^-33, above the engine's 1e-10 clamp, so it changes none;
a block with no such scale is refused (TGT004, predicted by validate: ``mocli.validate.reencode``). The manifest's
modules say ``reencoded_from: mxfp4``: verify proves the dequantized weights equal the source's bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mocli.census import Module
from mocli.kinds import Role
from mocli.plan.fp8_block_moe import BLOCK, _Fp8BlockMoe
from mocli.plan.mxfp4_fp8block import SpreadError, block_scales, reencode, unpack
from mocli.schemes.mxfp4 import NAN_SCALE
from mocli.stream.units import BadData
from mocli.tables import WEIGHT, WEIGHT_SCALE

if TYPE_CHECKING:
    from mocli.stream.pool import UnitContext

REENCODE = "reencode_mxfp4_e4m3_block_128"  # the transform every re-encoded tensor records
REENCODED_FROM = "mxfp4"  # module meta ``reencoded_from``: what verify proves the weights against
HINT = ("convert with --mxfp4-experts native (flashinfer-trtllm or marlin take the MXFP4 experts as they are); "
        "mocli validate --target T --mxfp4-experts fp8-block lists every such block")


def _codes(ctx: UnitContext, m: Module) -> tuple[np.ndarray, np.ndarray]:
    packed, codes = ctx.array(m.tensors[WEIGHT]), ctx.array(m.tensors[WEIGHT_SCALE])
    if bool((codes == NAN_SCALE).any()):
        raise BadData(m.tensors[WEIGHT_SCALE].name, "E8M0 scale bytes encode NaN (0xFF)")
    return packed, codes


def _refused(m: Module, err: SpreadError) -> BadData:
    return BadData(m.tensors[WEIGHT].name, f"{err}", code="TGT004", hint=HINT)


def encoded(ctx: UnitContext, m: Module) -> tuple[np.ndarray, np.ndarray]:
    """Module ``m``'s whole matrix re-encoded: (uint8 e4m3 codes [N, K], float32 block scales)."""
    try:
        return reencode(*_codes(ctx, m))
    except SpreadError as err:
        raise _refused(m, err) from None


def scales(ctx: UnitContext, m: Module) -> np.ndarray:
    packed, codes = _codes(ctx, m)
    try:
        return block_scales(unpack(packed), codes)
    except SpreadError as err:
        raise _refused(m, err) from None


class _Mxfp4Fp8BlockMoe(_Fp8BlockMoe):
    """Each stored tensor, weights and scales alike, is made from the experts' packed values and their E8M0 codes."""
    STEPS = [REENCODE]
    SCALE_STEPS: list[str] = []

    def w13_sources(self, r: int, name: str) -> list[str]:
        return self.src("up", WEIGHT, r) + self.src("gate", WEIGHT, r) + self.src("up", WEIGHT_SCALE, r) \
            + self.src("gate", WEIGHT_SCALE, r)

    def w2_sources(self, r: int, name: str) -> list[str]:
        return self.src("down", WEIGHT, r) + self.src("down", WEIGHT_SCALE, r)

    def meta(self) -> dict:
        return {**super().meta(), "reencoded_from": REENCODED_FROM, "activation": "silu"}

    def _w13_unit(self, e: int, g: Module, u: Module) -> None:
        lay = self.pc.layout

        def emit(ctx: UnitContext, halves, r: int, rows: tuple[int, int]) -> list:
            i0, i1 = rows  # [w3; w1]: FlashInfer computes act(second half) * first half
            return [np.ascontiguousarray(lay.block_moe_weight(np.concatenate([q[i0:i1] for q in halves])))]

        self.expert_unit("w13", e, Role.W13_WEIGHT, _inputs(u, g), emit,
                         lambda ctx: [encoded(ctx, m)[0] for m in (u, g)], compute=True)

    def _w2_unit(self, e: int, d: Module) -> None:
        lay = self.pc.layout

        def emit(ctx: UnitContext, q: np.ndarray, r: int, rows: tuple[int, int]) -> list:
            return [np.ascontiguousarray(lay.block_moe_weight(np.ascontiguousarray(q[:, rows[0]:rows[1]])))]

        self.expert_unit("w2", e, Role.W2_WEIGHT, _inputs(d), emit, lambda ctx: encoded(ctx, d)[0], compute=True)

    def _scale_unit(self, e: int) -> None:
        """An expert's block scales on every rank that holds it: the rank's block rows of I (w13) or columns (w2)."""
        g, u, d = self.mods[e]

        def w13(ctx: UnitContext, both, r: int, rows: tuple[int, int]) -> list:
            b0, b1 = rows[0] // BLOCK, rows[1] // BLOCK
            return [np.ascontiguousarray(np.concatenate([s[b0:b1] for s in both]))]

        def w2(ctx: UnitContext, s: np.ndarray, r: int, rows: tuple[int, int]) -> list:
            return [np.ascontiguousarray(s[:, rows[0] // BLOCK:rows[1] // BLOCK])]

        self.expert_unit("w13s", e, Role.W13_WEIGHT_SCALE, _inputs(u, g), w13,
                         lambda ctx: [scales(ctx, m) for m in (u, g)], compute=True)
        self.expert_unit("w2s", e, Role.W2_WEIGHT_SCALE, _inputs(d), w2, lambda ctx: scales(ctx, d), compute=True)


def _inputs(*mods: Module) -> list:
    return [m.tensors[s] for m in mods for s in (WEIGHT, WEIGHT_SCALE)]
