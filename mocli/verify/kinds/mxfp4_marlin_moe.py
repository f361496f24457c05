"""``mxfp4_marlin_moe`` (SEMANTICS §19.5), checked with numpy alone: per rank every expert's weight and
E8M0 scale bytes after ``mocli.targets.mxfp4_marlin_decode``'s inverses ([w1; w3] halves of Ip rows each,
padding zero) against the source's rank slice, then stage-wise emulated GEMMs (BF16 input and intermediate,
exact e2m1 x 2^e products) on sampled experts against the source, as ``mxfp8_moe``'s."""

from __future__ import annotations

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics.in_numpy import bf16_round
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets import mxfp4_marlin_decode as lay
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.decoded_moe import DecodedMoe
from mocli.verify.kinds.marlin_moe import halves_at
from mocli.verify.kinds.moe import check_moe
from mocli.verify.kinds.mxfp4_marlin_linear import source_dequant
from mocli.verify.kinds.mxfp4_moe import Mxfp4Moe, bf16
from mocli.verify.results import Problems

EMULATED_MOE = "emulated Marlin MXFP4 W4A16 MoE (decoded layout, exact products)"
GROUP = 32


class Mxfp4MarlinMoe(DecodedMoe):
    kind = ModuleKind.MXFP4_MARLIN_MOE
    label = EMULATED_MOE
    quant = staticmethod(bf16_round)

    @staticmethod
    def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
        return source_dequant(np.ascontiguousarray(w).view(np.uint8), s)

    def consistency(self, mod, experts, problems: Problems) -> None:
        if mod.padded_intermediate != mod.intermediate:
            problems.append(f"padded_intermediate is {mod.padded_intermediate}; vLLM's prepare_moe_fp4_layer_for_marlin "
                            f"pads nothing (I = {mod.intermediate})")
        if (mod.activation, mod.w13_rows, mod.act_dtype) != ("silu", "halves", "bfloat16"):
            problems.append(f"activation {mod.activation!r}, w13 rows {mod.w13_rows!r}, act_dtype {mod.act_dtype!r}: "
                            "this layout is silu on [w1; w3] halves for bfloat16")

    def decoded(self, mod, local: int) -> dict[str, np.ndarray]:
        """Expert ``local`` in logical order: w13 [up; gate] rows (the order the driver compares), w2."""
        i, h, ip, what = mod.intermediate, mod.hidden, mod.padded_intermediate, f"{mod.name}"
        w13 = lay.halves(lay.decode_weight(mod.w13_weight[local], 2 * ip, h, f"{what}.w13_weight[{local}]"),
                         i, ip, f"{what}.w13_weight[{local}]", w3_first=True)
        return {"w13_weight": w13, "w2_weight": lay.decode_weight(mod.w2_weight[local], h, i, f"{what}.w2_weight[{local}]"),
                **self.decoded_scales(mod, local)}

    @staticmethod
    def decoded_scales(mod, local: int) -> dict[str, np.ndarray]:
        """Expert ``local``'s E8M0 codes in logical order: w13's [up; gate] rows, w2's."""
        i, h, ip, what = mod.intermediate, mod.hidden, mod.padded_intermediate, f"{mod.name}"
        s13 = lay.halves(lay.decode_scales(mod.w13_weight_scale[local], 2 * ip, h // GROUP, f"{what}.w13_weight_scale[{local}]"),
                         i, ip, f"{what}.w13_weight_scale[{local}]", w3_first=True)
        return {"w13_weight_scale": s13, "w2_weight_scale": lay.decode_scales(mod.w2_weight_scale[local], h, i // GROUP,
                                                                              f"{what}.w2_weight_scale[{local}]")}

    def expert_bytes(self, mod, i_slice):
        """``DecodedMoe``'s check, the weights first matched in C where they can be (``weight_matches``): then
        only the scales are decoded. Anything else (a difference, a fault) goes the decoding way and is said
        as ever."""
        decoding = super().expert_bytes(mod, i_slice)

        def one(local: int, ex, found: Problems) -> None:
            want, i, h, ip = self.expected(ex, i_slice), mod.intermediate, mod.hidden, mod.padded_intermediate
            up, gate = want["w13_weight"]
            if not (lay.weight_matches(mod.w13_weight[local], 2 * ip, h, halves_at(i, ip, [gate, up]))
                    and lay.weight_matches(mod.w2_weight[local], h, i, [(slice(None), want["w2_weight"][0])])):
                return decoding(local, ex, found)
            got = self.decoded_scales(mod, local)
            for role in ("w13_weight_scale", "w2_weight_scale"):
                found.expect_parts(f"{role} (expert {ex.index})", np.ascontiguousarray(got[role]).view(np.uint8),
                                   [np.ascontiguousarray(p).view(np.uint8) for p in want[role]])

        return one

    def expected(self, ex, i_slice: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        (i0, i1), arr = i_slice, lambda m, role: self.src.arr(m.tensors[role].name)  # noqa: E731
        return {"w13_weight": [arr(ex.up, WEIGHT)[i0:i1], arr(ex.gate, WEIGHT)[i0:i1]],
                "w13_weight_scale": [arr(ex.up, WEIGHT_SCALE)[i0:i1], arr(ex.gate, WEIGHT_SCALE)[i0:i1]],
                "w2_weight": [arr(ex.down, WEIGHT)[:, i0 // 2:i1 // 2]],
                "w2_weight_scale": [arr(ex.down, WEIGHT_SCALE)[:, i0 // GROUP:i1 // GROUP]]}

    def source(self, ex, which: str, rows=None, cols=None) -> np.ndarray:
        m = getattr(ex, which)
        w, s = self.src.arr(m.tensors[WEIGHT].name), self.src.arr(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w, s = w[rows[0]:rows[1]], s[rows[0]:rows[1]]
        if cols is not None:
            w, s = w[:, cols[0] // 2:cols[1] // 2], s[:, cols[0] // GROUP:cols[1] // GROUP]
        return source_dequant(np.ascontiguousarray(w), s)


class Mxfp4MarlinGptOssMoe(Mxfp4Moe):
    """gpt-oss's experts in Marlin's layout (``w13_rows`` "interleaved"): ``mxfp4_moe``'s source side, padding
    sizes (vLLM pads alike for Marlin and TRT-LLM, §19.4), biases and GEMM stages, Marlin's bytes: each
    expert's words and E8M0 scales after the inverses (the rank's interleaved rows first, padding zero and the
    manifest's ``scale_pad``), the BF16 biases un-permuted (padding zero)."""

    kind = ModuleKind.MXFP4_MARLIN_MOE

    def consistency(self, mod, experts, problems: Problems) -> None:
        super().consistency(mod, experts, problems)
        if (mod.activation, mod.act_dtype) != ("swigluoai", "bfloat16"):
            problems.append(f"activation {mod.activation!r}, act_dtype {mod.act_dtype!r}: gpt-oss's experts are "
                            "swigluoai, built for bfloat16")

    def decoded_parts(self, mod, local: int) -> dict[str, list[np.ndarray]]:
        """Expert ``local`` as ``mxfp4_moe``'s parts: ``w13_*`` [up, gate] (odd and even rows), ``w2_*`` [rows]."""
        i, h, pad, what = mod.intermediate, mod.hidden, mod.scale_pad, mod.name
        w = lay.decode_weight(mod.w13_weight[local], 2 * i, h, f"{what}.w13_weight[{local}]")
        s = lay.decode_scales(mod.w13_weight_scale[local], 2 * i, h // GROUP, f"{what}.w13_weight_scale[{local}]", fill=pad)
        out = {"w13_weight": [w[1::2], w[0::2]], "w13_weight_scale": [s[1::2], s[0::2]],
               "w2_weight": [lay.decode_weight(mod.w2_weight[local], h, i, f"{what}.w2_weight[{local}]")],
               "w2_weight_scale": [lay.decode_scales(mod.w2_weight_scale[local], h, i // GROUP,
                                                     f"{what}.w2_weight_scale[{local}]", fill=pad)]}
        for which, n in (("w13", 2 * i), ("w2", h)):
            b = getattr(mod, f"{which}_bias")
            if b is not None:
                raw = np.ascontiguousarray(b[local]).view(np.uint8).reshape(-1, 2)
                v = lay.decode_bias(raw, n, f"{what}.{which}_bias[{local}]").view(np.uint16).reshape(-1)
                v = (v.astype(np.uint32) << 16).view(np.float32)
                out[f"{which}_bias"] = [v[1::2], v[0::2]] if which == "w13" else [v]
        return out

    def numbers(self, ck, mod, off, i_slice):
        return (EMULATED_MOE, *super().numbers(ck, mod, off, i_slice)[1:])

    def expected_parts(self, ex, i_slice, mod):
        """``mxfp4_moe``'s, the biases rounded to BF16 (vLLM's ``.to(params_dtype)``; exact for a BF16 source)."""
        out = super().expected_parts(ex, i_slice, mod)
        return {k: [bf16(p) for p in v] if k.endswith("_bias") else v for k, v in out.items()}


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    rows = next(iter(infos.values())).meta.get("w13_rows")
    return check_moe(name, infos, ctx, Mxfp4MarlinGptOssMoe if rows == "interleaved" else Mxfp4MarlinMoe)
