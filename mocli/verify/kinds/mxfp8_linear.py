"""``mxfp8_linear`` (SEMANTICS §14.2), checked with numpy alone: every weight and E8M0 scale byte after the
target's inverse transforms (rows unshuffled for trtllm, scales unswizzled, padding rows zero) against the
source, and emulated GEMMs (activations MXFP8-quantized per 32 values as vLLM's reference does; e4m3 times
a power of two, exact in float32) against the source's layer on the same activations."""

from __future__ import annotations

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics.in_numpy import E4M3, mxfp8_quant
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets.decode import LayoutError
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.dense import NumpyDenseCase, check_dense
from mocli.verify.results import THRESHOLDS, rng

EMULATED = "emulated MXFP8 (decoded layout, exact products)"
BLOCK = 32


def dequant(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [N, K] of e4m3 codes [N, K] and E8M0 biased exponents [N, K/32]."""
    return E4M3[codes] * np.repeat(np.exp2(scales.astype(np.float32) - 127), BLOCK, axis=1)


class Mxfp8LinearCheck(NumpyDenseCase):
    def __init__(self, kind: ModuleKind, shards, ctx: CheckContext) -> None:
        super().__init__(kind, shards, ctx)
        self.threshold = THRESHOLDS[kind].kept

    def draw(self, name, k):
        return rng(self.ctx.opts.seed, name).standard_normal((self.ctx.opts.tokens, k), dtype=np.float32)

    def quant(self, x, cols=None):
        return mxfp8_quant(x)

    def sampled_weights(self, offsets, sample):
        out = []
        for m, off in zip(self.shards, offsets, strict=True):
            local = sample[(sample >= off) & (sample < off + m.out_in[0])] - off
            if len(local):
                out.append(dequant(self.src.arr(m.tensors[WEIGHT].name)[local], self.src.arr(m.tensors[WEIGHT_SCALE].name)[local]))
        return np.concatenate(out)

    def load(self, ck, name):
        return ck.module_arrays(name)

    def check(self, mod, slices, problems) -> None:
        layout, name, np_ = self.ctx.layout, mod.name, mod.padded_n
        w = np.ascontiguousarray(layout.dense_rows_decode(np.ascontiguousarray(mod.weight).view(np.uint8)))
        bs = layout.nvfp4_scale_decode(mod.weight_scale, np_, mod.k // BLOCK, f"{name}.weight_scale")
        if bool(w[mod.n:].any()) or bool(bs[mod.n:].any()):
            raise LayoutError(f"{name}: padding rows past N = {mod.n} are not zero")
        self.w, self.bs = w[:mod.n], np.ascontiguousarray(bs[:mod.n])
        problems.expect_parts("weight", self.w, [self.src.arr(m.tensors[WEIGHT].name)[r0:r1, c0:c1]
                                                 for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])
        problems.expect_parts("weight_scale (E8M0 block scales)", self.bs, [
            self.src.arr(m.tensors[WEIGHT_SCALE].name)[r0:r1, c0 // BLOCK:c1 // BLOCK]
            for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])

    def kernel(self, ck, mod, xr, rows):
        return mxfp8_quant(xr) @ dequant(self.w[rows], self.bs[rows]).T, EMULATED, True


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_dense(name, infos, ctx, Mxfp8LinearCheck)
