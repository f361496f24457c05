"""``nvfp4_marlin_linear`` (SEMANTICS §13.5), checked with numpy alone: the padding vLLM would choose,
its power-of-two scale factor, every weight and block-scale byte after ``mocli.targets.marlin``'s
inverses (blocks under 2^-6 once scaled expected flushed to zero, as vLLM writes them), the global
scale, the bias; emulated weight-only GEMMs (BF16 activations, exact e2m1 x e4m3 products) against
the source's layer. vLLM's Marlin kernel itself runs on CUDA only: verify decodes, and says so.

What vLLM would compute is restated here from SEMANTICS, not taken from the converter
(``mocli.ops.marlin``), so a wrong rule there cannot pass its own check.
"""

from __future__ import annotations

import math

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics import FP8_MAX
from mocli.numerics.in_numpy import E4M3, bf16_round, scaled_matmul
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.targets import marlin_decode as lay
from mocli.verify.expect import apply_table
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.dense import NumpyDenseCase, check_dense
from mocli.verify.results import THRESHOLDS, rng

EMULATED = "emulated Marlin W4A16 (decoded layout, exact products)"


def expected_factor(codes: list[np.ndarray], act_dtype: str) -> float:
    """vLLM's ``_nvfp4_compute_scale_factor`` over these block-scale codes: 2^floor(log2(448 / largest
    nonzero scale)) when that scale is under 448, else 1; always 1 for fp16 activations."""
    top = max((float(E4M3[top_code(c)]) for c in codes if c.size), default=0.0)
    if act_dtype == "float16" or not 0 < top < FP8_MAX:
        return 1.0
    return 2.0 ** math.floor(math.log2(float(FP8_MAX) / top))


def top_code(c: np.ndarray) -> int:
    """The largest code of finite positive value: e4m3 codes 0..0x7E order as their values (0x7F is NaN,
    0x80.. negative, both ignored as vLLM's ``> 0`` ignores them)."""
    top = int(c.max())
    return top if top < 0x7F else int(np.max(c, initial=0, where=c < 0x7F))


def expected_global(s2, sf: float, act_dtype: str) -> np.ndarray:
    """``S2 * 2^(exponent bias - 7) / sf``, float32 (``nvfp4_marlin_process_global_scale``)."""
    shift = {"bfloat16": 126 - 7, "float16": 14 - 7}[act_dtype]
    return (np.asarray(s2, dtype=np.float32) * np.float32(2.0**shift) / np.float32(sf)).astype(np.float32)


def expected_padding(n: int, k: int) -> tuple[int, int]:
    """``marlin_padded_nk``: the cheaper of (N to 64, K to 128) and (N to 128, K to 64), ties to the first."""
    up = lambda v, m: -(-v // m) * m  # noqa: E731
    a, b = (up(n, 64), up(k, 128)), (up(n, 128), up(k, 64))
    return a if (a[0] * a[1], sum(a)) <= (b[0] * b[1], sum(b)) else b


class MarlinLinearCheck(NumpyDenseCase):
    def __init__(self, kind: ModuleKind, shards, ctx: CheckContext) -> None:
        super().__init__(kind, shards, ctx)
        self.s2 = [self.src.scalar(m, WEIGHT_SCALE_2) for m in shards]
        self.big_s2 = np.max(self.s2)
        self.big_a = np.max([self.src.scalar(m, INPUT_SCALE) for m in shards]) \
            if all(INPUT_SCALE in m.tensors for m in shards) else None
        limits = THRESHOLDS[kind]
        self.threshold = limits.unified if any(v != self.big_s2 for v in self.s2) else limits.kept

    def draw(self, name, k):
        return rng(self.ctx.opts.seed, name).standard_normal((self.ctx.opts.tokens, k), dtype=np.float32)

    def quant(self, x, cols=None):
        return bf16_round(x)  # weight-only: the activations as the BF16 model hands them over

    def sampled_weights(self, offsets, sample):
        return np.concatenate([self.src.nvfp4_dequant(m, local) for m, off in zip(self.shards, offsets, strict=True)
                               if len(local := sample[(sample >= off) & (sample < off + m.out_in[0])] - off)])

    def load(self, ck, name):
        mod = ck.module_arrays(name)
        if mod.bias is not None:  # compared in logical order: un-permuted, the padding checked zero
            raw = np.ascontiguousarray(mod.bias).view(np.uint8).reshape(mod.padded_n, -1)
            mod.bias = np.ascontiguousarray(lay.decode_bias(raw, mod.n, f"{name}.bias")).view(mod.bias.dtype).reshape(-1)
        return mod

    def check(self, mod, slices, problems) -> None:
        src, name = self.src, mod.name
        if (mod.padded_n, mod.padded_k) != (want := expected_padding(mod.n, mod.k)):
            problems.append(f"padded (n, k) is {(mod.padded_n, mod.padded_k)}, vLLM pads to {want}")
        codes = [apply_table("rescale", src.arr(m.tensors[WEIGHT_SCALE].name)[r0:r1, c0 // 16:c1 // 16], si, self.big_s2)
                 for m, si, (r0, r1, c0, c1) in zip(self.shards, self.s2, slices, strict=True)]
        sf = expected_factor(codes, mod.act_dtype)
        if mod.scale_factor != sf:
            problems.append(f"scale_factor is {mod.scale_factor}, vLLM computes {sf} from the block scales")
        problems.scalar("weight_global_scale", mod.weight_global_scale, expected_global(self.big_s2, sf, mod.act_dtype))
        if self.big_a is not None and mod.input_global_scale is not None:
            problems.scalar("input_global_scale", mod.input_global_scale, self.big_a)
        self.w = lay.decode_weight(mod.weight, mod.n, mod.k, f"{name}.weight")
        self.bs = lay.decode_scales(mod.weight_scale, mod.n, mod.k // 16, mod.scale_factor, f"{name}.weight_scale")
        problems.expect_parts("weight", self.w, [src.arr(m.tensors[WEIGHT].name)[r0:r1, c0 // 2:c1 // 2]
                                                 for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])
        problems.expect_parts("weight_scale (block scales, flushed under 2^-6)", self.bs,
                              [lay.flushed(c, sf) for c in codes])
        self.s2_read = lay.global_of(mod.weight_global_scale, mod.scale_factor, mod.act_dtype)

    def kernel(self, ck, mod, xr, rows):
        return scaled_matmul(bf16_round(xr), self.w[rows], self.bs[rows]) * self.s2_read, EMULATED, True


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_dense(name, infos, ctx, MarlinLinearCheck)
