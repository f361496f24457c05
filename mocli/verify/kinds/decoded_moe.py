"""The numpy check shared by MoE kinds verified from their decoded layout (``mxfp8_moe``, ``fp8_block_moe``):
per rank every expert's bytes after the layout's inverses (on a thread beside the GEMMs), then stage-wise
emulated GEMMs on sampled experts, the input and the intermediate quantized as the kind's kernels do. A kind
says how it decodes a rank's expert (``decoded``), what the source gives for it (``expected``, ``source``), how
activations are quantized (``quant``) and how a weight dequantizes (``dequant``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mocli.errors import CorruptFileError
from mocli.numerics.in_numpy import silu
from mocli.targets.decode import LayoutError
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.moe import MoeCase
from mocli.verify.results import CPU_SAMPLE_EXPERTS, Problems, Stages, pick_experts, rel_error, rng


class DecodedMoe(MoeCase):
    label: str  # the kernel column of the report
    errors = (LayoutError, CorruptFileError, ValueError)
    bytes_threads = "mocli-verify-moe-bytes"

    def __init__(self, name: str, ctx: CheckContext) -> None:
        super().__init__(name, ctx)
        self.layout, self.opts = ctx.layout, ctx.opts
        self.x = rng(ctx.opts.seed, name).standard_normal((ctx.opts.tokens, self.layer.hidden), dtype=np.float32)
        self.ref_in = self.quant(self.x)

    @staticmethod
    def quant(x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def decoded(self, mod, local: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def expected(self, ex, i_slice: tuple[int, int]) -> dict[str, list[np.ndarray]]:
        raise NotImplementedError

    def source(self, ex, which: str, rows=None, cols=None) -> np.ndarray:
        raise NotImplementedError

    def load(self, ck):
        return ck.module_arrays(self.name)

    def expert_bytes(self, mod, i_slice):
        def one(local: int, ex, found: Problems) -> None:
            got = self.decoded(mod, local)
            for role, parts in self.expected(ex, i_slice).items():
                found.expect_parts(f"{role} (expert {ex.index})", np.ascontiguousarray(got[role]).view(np.uint8),
                                   [np.ascontiguousarray(p).view(np.uint8) for p in parts])

        return one

    def reference(self, gid: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ex = self.layer.experts[gid]
        g1 = self.ref_in @ np.concatenate([self.source(ex, "up"), self.source(ex, "gate")]).T
        return g1, h @ self.source(ex, "down").T

    def numbers(self, ck, mod, off: int, i_slice: tuple[int, int]) -> tuple[Any, ...]:
        i0, i1 = i_slice
        sample = pick_experts(mod.experts, CPU_SAMPLE_EXPERTS, self.opts.seed, mod.name)
        stages, outs = Stages(len(sample)), {}
        for local in sample:
            gid, ex, got = off + local, self.layer.experts[off + local], self.decoded(mod, local)
            ref1 = self.ref_in @ np.concatenate([self.source(ex, "up", rows=i_slice), self.source(ex, "gate", rows=i_slice)]).T
            o1 = self.ref_in @ self.dequant(got["w13_weight"], got["w13_weight_scale"]).T
            i = i1 - i0
            h_true = self.quant(silu(o1[:, i:]) * o1[:, :i])
            o2 = h_true @ self.dequant(got["w2_weight"], got["w2_weight_scale"]).T
            ref2 = h_true @ self.source(ex, "down", cols=i_slice).T
            stages.add("gemm1", rel_error(o1, ref1), self.limits.kept)
            stages.add("gemm2", rel_error(o2, ref2), self.limits.gemm2)
            outs[gid] = (o1, o2, h_true)
        return self.label, True, stages.errors, stages.result(), outs
