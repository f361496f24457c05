"""``mxfp4_marlin_linear`` (SEMANTICS §19.5), checked with numpy alone: the padding vLLM would choose,
every weight byte and E8M0 scale byte after ``mocli.targets.mxfp4_marlin_decode``'s inverses against the
source's (nothing rescaled, nothing flushed: the bytes only move), the bias (un-permuted, padding zero);
an emulated weight-only GEMM (BF16 activations, exact e2m1 x 2^e products) against the source's layer.
vLLM's Marlin kernel runs on CUDA only: verify decodes, and says so.

The padding rule is restated here from SEMANTICS, not taken from the converter (``mocli.ops``).
"""

from __future__ import annotations

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics.in_numpy import bf16_round, unpack_e2m1
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.targets import mxfp4_marlin_decode as lay
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.dense import NumpyDenseCase, check_dense
from mocli.verify.kinds.marlin_linear import MarlinLinearCheck, expected_padding
from mocli.verify.results import THRESHOLDS

EMULATED = "emulated Marlin MXFP4 W4A16 (decoded layout, exact products)"
GROUP = 32


def source_dequant(packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """A source MXFP4 weight: e2m1 values times 2^(code - 127), float32 [n, k] (SEMANTICS §19.1)."""
    vals = unpack_e2m1(packed)
    blocks = vals.reshape(vals.shape[0], -1, GROUP)  # each block of 32 scaled in place: no [n, k] scale
    blocks *= np.exp2(codes.astype(np.float32) - np.float32(127))[..., None]
    return vals


class Mxfp4MarlinLinearCheck(NumpyDenseCase):
    def __init__(self, kind: ModuleKind, shards, ctx: CheckContext) -> None:
        super().__init__(kind, shards, ctx)
        self.threshold = THRESHOLDS[kind].kept

    # weight-only like NVFP4's Marlin: the same BF16 activations, and the same bias un-permute on load
    draw, quant, load = MarlinLinearCheck.draw, MarlinLinearCheck.quant, MarlinLinearCheck.load

    def sampled_weights(self, offsets, sample):
        out = []
        for m, off in zip(self.shards, offsets, strict=True):
            local = sample[(sample >= off) & (sample < off + m.out_in[0])] - off
            if len(local):
                out.append(source_dequant(self.src.arr(m.tensors[WEIGHT].name)[local],
                                          self.src.arr(m.tensors[WEIGHT_SCALE].name)[local]))
        return np.concatenate(out)

    def check(self, mod, slices, problems) -> None:
        src, name = self.src, mod.name
        if (mod.padded_n, mod.padded_k) != (want := expected_padding(mod.n, mod.k)):
            problems.append(f"padded (n, k) is {(mod.padded_n, mod.padded_k)}, vLLM pads to {want}")
        if mod.act_dtype != "bfloat16":
            problems.append(f"act_dtype is {mod.act_dtype!r}; the E8M0 bytes are vLLM's for bfloat16 only")
        self.w = lay.decode_weight(mod.weight, mod.n, mod.k, f"{name}.weight")
        self.codes = lay.decode_scales(mod.weight_scale, mod.n, mod.k // GROUP, f"{name}.weight_scale")
        problems.expect_parts("weight", self.w, [src.arr(m.tensors[WEIGHT].name)[r0:r1, c0 // 2:c1 // 2]
                                                 for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])
        problems.expect_parts("weight_scale (E8M0 codes)", self.codes,
                              [src.arr(m.tensors[WEIGHT_SCALE].name)[r0:r1, c0 // GROUP:c1 // GROUP]
                               for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])

    def kernel(self, ck, mod, xr, rows):
        w = lay.dequant(self.w[rows], self.codes[rows])
        return bf16_round(xr) @ w.T, EMULATED, True


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_dense(name, infos, ctx, Mxfp4MarlinLinearCheck)
