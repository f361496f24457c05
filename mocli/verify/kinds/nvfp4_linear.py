"""``nvfp4_linear`` (SEMANTICS §6), checked with numpy alone: every byte of the weight and block scales
after the target's inverse transforms, every derived scale, emulated GEMMs against the source.

An NVFP4 conversion only moves bytes and never loads torch; its check need not either. The e2m1
products and e4m3 block scales are exact in float32, so numpy's float32 GEMMs are the same emulation
torch ran, and importing torch alone took longer than the whole conversion (3.4 s against 2.6-3.2 s
on the H200 machine). Torch comes in only for FlashInfer's NVFP4 kernels (sm_100+), through
``Fp4Kernels``.
"""

from __future__ import annotations

import numpy as np

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics import E2M1_MAX, FP8_MAX
from mocli.numerics.in_numpy import bf16_round, nvfp4_quant, scaled_matmul
from mocli.tables import INPUT_SCALE, PRE_QUANT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.verify.expect import apply_table
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.dense import NumpyDenseCase, check_dense
from mocli.verify.results import THRESHOLDS, rng
from mocli.verify.source import floats

EMULATED = "emulated NVFP4 (decoded layout, exact products)"
ONE = np.float32(1)


class Fp4Kernels:
    """FlashInfer's NVFP4 kernels (sm_100+), where they run: the one part of an NVFP4 check that needs
    torch. ``rt`` is a ``mocli.verify.common.Runtime`` whose ``fp4_kernels()`` holds."""

    def __init__(self, rt) -> None:
        self.rt = rt

    def mm(self, ck, name: str, xr: np.ndarray) -> np.ndarray:  # pragma: no cover - sm_100+
        import torch

        from mocli.verify import flashinfer_args

        mod = ck.load_module(name, self.rt.device)
        return flashinfer_args.run_mm_fp4(mod, torch.from_numpy(xr).to(self.rt.device)).cpu().numpy()

    def fused_moe(self, ck, name: str, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:  # pragma: no cover
        import torch

        from mocli.verify import flashinfer_args

        mod = ck.load_module(name, self.rt.device)
        t = [torch.from_numpy(a).to(self.rt.device) for a in (x, ids, w)]
        return flashinfer_args.run_cutlass_fused_moe_nvfp4(mod, *t).cpu().numpy()


class Nvfp4LinearCheck(NumpyDenseCase):
    def __init__(self, kind: ModuleKind, shards, ctx: CheckContext) -> None:
        super().__init__(kind, shards, ctx)
        src = self.src
        self.s2 = [src.scalar(m, WEIGHT_SCALE_2) for m in shards]
        self.big_s2 = np.max(self.s2)  # numpy's max: a NaN scale stays NaN (and fails), as torch's did
        a = [src.scalar(m, INPUT_SCALE) for m in shards]
        self.big_a = np.max(a)
        self.a_inv = src.inverse(shards[int(np.argmax(a))], INPUT_SCALE)
        limits = THRESHOLDS[kind]
        self.threshold = limits.unified if any(v != self.big_s2 for v in self.s2) else limits.kept
        pqs = shards[0].tensors.get(PRE_QUANT_SCALE)  # NVFP4_AWQ (SEMANTICS §15): equal on every shard (AWQ001)
        self.pqs = None if pqs is None else bf16_round(src.floats(pqs.name))

    def draw(self, name, k):
        return rng(self.ctx.opts.seed, name).standard_normal((self.ctx.opts.tokens, k), dtype=np.float32) * np.float32(
            float(self.big_a) * FP8_MAX * E2M1_MAX / 4)

    def quant(self, x, cols=None):
        if self.pqs is not None:  # x * pre_quant_scale in BF16, before the activation quantization
            x = bf16_round(bf16_round(x) * self.pqs[slice(*cols) if cols else slice(None)])
        return nvfp4_quant(x, self.a_inv) * self.big_a

    def sampled_weights(self, offsets, sample):
        return np.concatenate([self.src.nvfp4_dequant(m, local) for m, off in zip(self.shards, offsets, strict=True)
                               if len(local := sample[(sample >= off) & (sample < off + m.out_in[0])] - off)])

    def load(self, ck, name):
        return ck.module_arrays(name)

    def check(self, mod, slices, problems) -> None:
        src, layout, name, big_s2, big_a = self.src, self.ctx.layout, mod.name, self.big_s2, self.big_a
        problems.scalar("weight_scale_2", mod.weight_scale_2, big_s2)
        problems.scalar("input_scale", mod.input_scale, big_a)
        problems.scalar("alpha", mod.alpha, big_a * big_s2)
        problems.scalar("input_scale_inv", mod.input_scale_inv, self.a_inv)
        if (self.pqs is None) != (mod.pre_quant_scale is None):
            problems.append("pre_quant_scale: " + ("the source has one, the layout none" if mod.pre_quant_scale is None
                                                   else "the layout has one, the source none"))
        elif self.pqs is not None:
            c0, c1 = slices[0][2], slices[0][3]
            self.pqs_stored = floats(mod.pre_quant_scale, "BF16")
            problems.expect_equal("pre_quant_scale (BF16)", self.pqs_stored, self.pqs[c0:c1])
        self.w = layout.nvfp4_weight_decode(mod.weight, mod.n, mod.k, f"{name}.weight")
        self.bs = layout.nvfp4_scale_decode(mod.weight_scale, mod.n, mod.k // 16, f"{name}.weight_scale")
        problems.expect_parts("weight", self.w, [src.arr(m.tensors[WEIGHT].name)[r0:r1, c0 // 2:c1 // 2]
                                                 for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)])
        problems.expect_parts("weight_scale (block scales)", self.bs, [
            apply_table("rescale", src.arr(m.tensors[WEIGHT_SCALE].name)[r0:r1, c0 // 16:c1 // 16], si, big_s2)
            for m, si, (r0, r1, c0, c1) in zip(self.shards, self.s2, slices, strict=True)])

    def kernel(self, ck, mod, xr, rows):
        if mod.pre_quant_scale is not None:  # the stored vector, applied as the serving kernel does
            xr = bf16_round(bf16_round(xr) * self.pqs_stored)
        if self.ctx.fp4 is not None:
            return self.ctx.fp4.mm(ck, mod.name, xr)[:, rows], "flashinfer.mm_fp4", False
        xa = nvfp4_quant(xr, mod.input_scale_inv)  # e2m1 * sf: exact in float32
        return scaled_matmul(xa, self.w[rows], self.bs[rows]) * mod.alpha, EMULATED, True


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    return check_dense(name, infos, ctx, Nvfp4LinearCheck)
