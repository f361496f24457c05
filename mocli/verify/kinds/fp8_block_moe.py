"""``fp8_block_moe`` (SEMANTICS §18.2), checked with numpy alone: per rank every expert's weight bytes after the
layout's inverse (flashinfer-trtllm: BlockMajorK and the 16-row shuffle undone) as [w3; w1] rows of the source,
its float32 block scales as the source's, clamped to 1e-10 and in the same row order, and emulated stage-wise
GEMMs on sampled experts (the input and the intermediate FP8-quantized per token and group of 128, as the
kernels do) against the source. Experts re-encoded from MXFP4 (``ReencodedFp8BlockMoe``): their dequantized
values against the MXFP4 source's, bit for bit, instead of the bytes."""

from __future__ import annotations

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics.in_numpy import E4M3, fp8_per_group_quant, unpack_e2m1
from mocli.schemes import MXFP4
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.decoded_moe import DecodedMoe
from mocli.verify.kinds.moe import check_moe
from mocli.verify.results import Problems

EMULATED = "emulated FP8 block-scale MoE (decoded layout, float32 GEMMs)"
BLOCK = 128
MIN_SCALE = np.float32(1e-10)  # vLLM's clamp of FlashInfer's block scales (prepare_fp8_moe_layer_for_fi)


def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """uint8 e4m3 codes [M, K] times their [M/128, K/128] block scales, float32."""
    full = np.repeat(np.repeat(np.asarray(s, dtype=np.float32), BLOCK, axis=0), BLOCK, axis=1)
    return E4M3[w] * full[:w.shape[0], :w.shape[1]]


class Fp8BlockMoe(DecodedMoe):
    kind = ModuleKind.FP8_BLOCK_MOE
    label = EMULATED
    quant = staticmethod(fp8_per_group_quant)
    dequant = staticmethod(dequant)

    def consistency(self, mod, experts, problems: Problems) -> None:
        if list(getattr(mod, "block", [BLOCK, BLOCK])) != [BLOCK, BLOCK]:
            problems.append(f"block is {mod.block}, the kernels take [128, 128]")

    def decoded(self, mod, local: int) -> dict[str, np.ndarray]:
        """Expert ``local`` in logical order: w13 [up; gate] [2I, H] uint8, w2 [H, I], their float32 scales."""
        out = {}
        for which in ("w13", "w2"):
            stored = np.ascontiguousarray(getattr(mod, f"{which}_weight")[local]).view(np.uint8)
            out[f"{which}_weight"] = np.ascontiguousarray(self.layout.block_moe_decode(stored))
            out[f"{which}_weight_scale"] = np.asarray(getattr(mod, f"{which}_weight_scale")[local], dtype=np.float32)
        return out

    def _scale(self, m) -> np.ndarray:
        e = m.tensors[WEIGHT_SCALE]
        return np.maximum(self.src.floats(e.name).reshape(-1, e.shape[-1]), MIN_SCALE).astype(np.float32)

    def expected(self, ex, i_slice: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        (i0, i1), b0, b1 = i_slice, i_slice[0] // BLOCK, i_slice[1] // BLOCK
        w = lambda m: self.src.arr(m.tensors[WEIGHT].name)  # noqa: E731
        return {"w13_weight": [w(ex.up)[i0:i1], w(ex.gate)[i0:i1]], "w2_weight": [w(ex.down)[:, i0:i1]],
                "w13_weight_scale": [self._scale(ex.up)[b0:b1], self._scale(ex.gate)[b0:b1]],
                "w2_weight_scale": [self._scale(ex.down)[:, b0:b1]]}

    def source(self, ex, which: str, rows=None, cols=None) -> np.ndarray:
        m = getattr(ex, which)
        w, s = np.ascontiguousarray(self.src.arr(m.tensors[WEIGHT].name)).view(np.uint8), self._scale(m)
        if rows is not None:
            w, s = w[rows[0]:rows[1]], s[rows[0] // BLOCK:rows[1] // BLOCK]
        if cols is not None:
            w, s = w[:, cols[0]:cols[1]], s[:, cols[0] // BLOCK:cols[1] // BLOCK]
        return dequant(np.ascontiguousarray(w), s)


# --- re-encoded from MXFP4 (convert --mxfp4-experts fp8-block, SEMANTICS §19.7) ------------------------------
# Per rank, every expert's stored e4m3 weights (the layout's inverse undone) times their float32 block scales
# (clamped to 1e-10 as the engine does) equal the MXFP4 source's e2m1 values times 2^(code - 127), bit for bit,
# over the rank's rows of I (w13, [w3; w1]) and columns (w2); the manifest must record the re-encoding; then the
# emulated GEMMs against the source's exact values. The source is decoded here, apart from the converter's
# encoder (``mocli.plan.mxfp4_fp8block``).

REENCODED_FROM = "mxfp4"


def decode_mxfp4(packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """e2m1 [N, K/2] times 2^(E8M0 [N, K/32] - 127), float32 [N, K] (exact: a power of two times e2m1)."""
    scale = np.ldexp(np.float32(1.0), codes.astype(np.int32) - 127).astype(np.float32)
    return unpack_e2m1(np.ascontiguousarray(packed)) * np.repeat(scale, 32, axis=1)


class ReencodedFp8BlockMoe(Fp8BlockMoe):
    label = EMULATED + "; re-encoded from MXFP4"

    def __init__(self, name, ctx) -> None:
        super().__init__(name, ctx)
        self._decoded: dict[str, np.ndarray] = {}

    def consistency(self, mod, experts, problems: Problems) -> None:
        super().consistency(mod, experts, problems)
        if getattr(mod, "reencoded_from", None) != REENCODED_FROM:
            problems.append(f"the source's experts are MXFP4 but the manifest records no re-encoding from them "
                            f"(reencoded_from: {getattr(mod, 'reencoded_from', None)!r})")

    def _values(self, m) -> np.ndarray:
        name = m.tensors[WEIGHT].name
        if name not in self._decoded:
            self._decoded[name] = decode_mxfp4(self.src.arr(name), self.src.arr(m.tensors[WEIGHT_SCALE].name))
        return self._decoded[name]

    def source(self, ex, which: str, rows=None, cols=None) -> np.ndarray:
        w = self._values(getattr(ex, which))
        if rows is not None:
            w = w[rows[0]:rows[1]]
        if cols is not None:
            w = w[:, cols[0]:cols[1]]
        return w

    def expert_bytes(self, mod, i_slice):
        def one(local: int, ex, found: Problems) -> None:
            got = self.decoded(mod, local)
            want = {"w13_weight": np.concatenate([self.source(ex, "up", rows=i_slice), self.source(ex, "gate", rows=i_slice)]),
                    "w2_weight": self.source(ex, "down", cols=i_slice)}
            for which, ref in want.items():
                scale = np.maximum(got[f"{which}_scale"], MIN_SCALE)
                _same(found, f"{which} (expert {ex.index})", dequant(got[which], scale), ref)

        return one


def _same(found: Problems, what: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit (+0.0 and -0.0 alike: the kernels' products do not tell them apart)."""
    if got.shape != want.shape:
        found.append(f"{what} dequantizes to {list(got.shape)}, the MXFP4 source's slice is {list(want.shape)}")
        return
    diff = (got + np.float32(0)).view(np.uint32) != (want + np.float32(0)).view(np.uint32)
    if bool(diff.any()):
        r, c = (int(v) for v in np.argwhere(diff)[0])
        found.append(f"{what}: dequantized block FP8 differs from the MXFP4 source in {int(diff.sum())} value(s), "
                     f"first at [{r}, {c}] (block ({r // BLOCK}, {c // BLOCK})): {got[r, c]!r}, the source "
                     f"{want[r, c]!r}")


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    """MXFP4 source experts were re-encoded (convert --mxfp4-experts fp8-block): proven against their values."""
    return check_moe(name, infos, ctx, ReencodedFp8BlockMoe if MXFP4 in ctx.src.layers[name].schemes else Fp8BlockMoe)
