"""``mxfp8_moe`` (SEMANTICS §14.3), checked with numpy alone: per rank the padded sizes trtllm uses, every
expert's weight and E8M0 scale bytes after the layout's inverses (rows un-shuffled and un-interleaved to
[w3; w1], scales unswizzled; weight padding zero, scale padding 127), and emulated stage-wise GEMMs on
sampled experts (input and intermediate MXFP8-quantized per 32 values) against the source."""

from __future__ import annotations

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics.in_numpy import mxfp8_quant
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets.decode import LayoutError, unswizzle
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.decoded_moe import DecodedMoe
from mocli.verify.kinds.moe import check_moe
from mocli.verify.kinds.mxfp8_linear import dequant
from mocli.verify.results import Problems

EMULATED_MOE = "emulated MXFP8 MoE (decoded layout, exact products)"
SCALE_ONE = 127  # E8M0 2^0, trtllm's padding scale


class Mxfp8Moe(DecodedMoe):
    kind = ModuleKind.MXFP8_MOE
    label = EMULATED_MOE
    quant = staticmethod(mxfp8_quant)

    @staticmethod
    def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
        return dequant(w, s)

    def consistency(self, mod, experts, problems: Problems) -> None:
        ip, hp = -(-mod.intermediate // 128) * 128, -(-mod.hidden // 256) * 256
        if (mod.padded_intermediate, mod.padded_hidden) != (ip, hp):
            problems.append(f"padded (I, H) are {(mod.padded_intermediate, mod.padded_hidden)}, trtllm pads to {(ip, hp)}")

    def decoded(self, mod, local: int) -> dict[str, np.ndarray]:
        """Expert ``local``'s rows in logical order, padding checked and cut: w13 [up; gate] [2I, H] and its
        scales [2I, H/32], w2 [H, I] and its scales [H, I/32]."""
        i, h, ip = mod.intermediate, mod.hidden, mod.padded_intermediate
        out = {}
        for which, gated, keep_rows, cols in (("w13", True, np.r_[0:i, ip:ip + i], h), ("w2", False, np.r_[0:h], i)):
            w = self.layout.moe_rows_decode(np.ascontiguousarray(getattr(mod, f"{which}_weight")[local]).view(np.uint8), gated)
            s_st = getattr(mod, f"{which}_weight_scale")[local]
            s = self.layout.moe_rows_decode(unswizzle(s_st, *s_st.shape, f"{mod.name}.{which}_weight_scale[{local}]"), gated)
            wpad, spad = np.ones(w.shape, bool), np.ones(s.shape, bool)
            wpad[np.ix_(keep_rows, np.arange(cols))] = False
            spad[np.ix_(keep_rows, np.arange(cols // 32))] = False
            if bool(w[wpad].any()) or bool((s[spad] != SCALE_ONE).any()):
                raise LayoutError(f"{mod.name}.{which} (expert {local}): padding is not zero weights and 127 scales")
            out[f"{which}_weight"] = w[np.ix_(keep_rows, np.arange(cols))]
            out[f"{which}_weight_scale"] = s[np.ix_(keep_rows, np.arange(cols // 32))]
        return out

    def expected(self, ex, i_slice: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        (i0, i1), arr = i_slice, lambda m, role: self.src.arr(m.tensors[role].name)  # noqa: E731
        return {"w13_weight": [arr(ex.up, WEIGHT)[i0:i1], arr(ex.gate, WEIGHT)[i0:i1]],
                "w13_weight_scale": [arr(ex.up, WEIGHT_SCALE)[i0:i1], arr(ex.gate, WEIGHT_SCALE)[i0:i1]],
                "w2_weight": [arr(ex.down, WEIGHT)[:, i0:i1]], "w2_weight_scale": [arr(ex.down, WEIGHT_SCALE)[:, i0 // 32:i1 // 32]]}

    def source(self, ex, which: str, rows=None, cols=None) -> np.ndarray:
        m = getattr(ex, which)
        w, s = self.src.arr(m.tensors[WEIGHT].name), self.src.arr(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w, s = w[rows[0]:rows[1]], s[rows[0]:rows[1]]
        if cols is not None:
            w, s = w[:, cols[0]:cols[1]], s[:, cols[0] // 32:cols[1] // 32]
        return dequant(np.ascontiguousarray(w).view(np.uint8), s)


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_moe(name, infos, ctx, Mxfp8Moe)
