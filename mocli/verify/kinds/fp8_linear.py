"""``fp8_linear``, ``fp8_channel_linear``, ``fp8_block_linear`` (SEMANTICS §3, §8), in torch: bytes and
scales against the source (FP8 shards requantized to the max scale by verify's own tables), then the
kernel a GPU runs (``torch._scaled_mm``; emulated where there is none) against the source's layer. One
case per kind, in ``CASES``."""

from __future__ import annotations

import numpy as np
import torch

from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.numerics import FP8_MAX
from mocli.numerics.in_torch import fp8_per_group_dequant, fp8_per_token, fp8_static
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE
from mocli.verify.common import gen, rows_of, scaled_mm
from mocli.verify.expect import apply_table, src_requant, to_numpy
from mocli.verify.kinds.context import CheckContext
from mocli.verify.kinds.dense import DenseCase, check_dense
from mocli.verify.results import THRESHOLDS


class _Fp8Dense(DenseCase):
    """What the FP8 kinds share: torch tensors on the verify device."""

    x_scale: float = 1.0

    def __init__(self, kind, shards, ctx: CheckContext) -> None:
        super().__init__(kind, shards, ctx)
        self.device = ctx.rt.device
        self.threshold = THRESHOLDS[kind].kept

    def draw(self, name, k):
        return (torch.randn(self.ctx.opts.tokens, k, generator=gen(self.ctx.opts.seed, name)) * self.x_scale
                ).to(self.device)

    def sampled_weights(self, offsets, sample):
        t = torch.from_numpy(sample)
        return torch.cat([self.src.fp8_dequant(m, local) for m, off in zip(self.shards, offsets, strict=True)
                          if len(local := t[(t >= off) & (t < off + m.out_in[0])] - off)])

    def load(self, ck, name):
        return ck.load_module(name, self.device)

    def weights(self, slices) -> list[torch.Tensor]:
        return [self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0:c1]
                for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)]

    def source_rows(self, m, suffix, a, b):
        return self.src.cpu(m.tensors[suffix].name)[a:b]

    def stored_bias(self, ck, info, mod):
        return mod.bias.float()

    def bias_full(self):
        return torch.cat([self.src.cpu(m.tensors["bias"].name) for m in self.shards]).float().to(self.device)

    def index(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows).to(self.device)

    def to_numpy(self, a) -> np.ndarray:
        return to_numpy(a)

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)


class _Fp8Tensor(_Fp8Dense):
    def __init__(self, kind, shards, ctx) -> None:
        super().__init__(kind, shards, ctx)
        self.s = [self.src.scalar_t(m, WEIGHT_SCALE) for m in shards]
        self.big_s = torch.stack(self.s).max()
        self.big_a = torch.stack([self.src.scalar_t(m, INPUT_SCALE) for m in shards]).max()
        self.x_scale = float(self.big_a) * FP8_MAX / 4

    def quant(self, x, cols=None):
        return fp8_static(x, self.big_a).float() * self.big_a.to(x.device)

    def check(self, mod, slices, problems) -> None:
        problems.scalar("weight_scale", mod.weight_scale, self.big_s)
        problems.scalar("input_scale", mod.input_scale, self.big_a)
        problems.expect_parts("weight", mod.weight, [
            apply_table(src_requant(self.src), self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0:c1], si, self.big_s)
            for m, si, (r0, r1, c0, c1) in zip(self.shards, self.s, slices, strict=True)])

    def kernel(self, ck, mod, xr, rows):
        rows = torch.from_numpy(rows)
        xq = fp8_static(xr, mod.input_scale)
        out = scaled_mm(xq, rows_of(mod.weight, rows), mod.input_scale.float(), mod.weight_scale.float())
        return out, "torch._scaled_mm", False


class _Fp8Channel(_Fp8Dense):
    def quant(self, x, cols=None):
        q, s = fp8_per_token(x)
        return q.float() * s

    def check(self, mod, slices, problems) -> None:
        problems.expect_parts("weight", mod.weight, self.weights(slices))
        row_split = slices[0][2] != 0 or slices[0][3] != self.shards[0].out_in[1]
        scales = [self.src.cpu(m.tensors[WEIGHT_SCALE].name).reshape(-1) for m in self.shards]
        problems.scalar("weight_scale", mod.weight_scale, torch.cat(
            scales if row_split else [sc[r0:r1] for sc, (r0, r1, _, _) in zip(scales, slices, strict=True)]))

    def kernel(self, ck, mod, xr, rows):
        rows = torch.from_numpy(rows)
        xq, xs = fp8_per_token(xr)
        w, ws = rows_of(mod.weight, rows), mod.weight_scale.float()[rows.to(xr.device)]
        try:
            return scaled_mm(xq, w, xs, ws), "torch._scaled_mm (rowwise)", False
        except (RuntimeError, NotImplementedError):
            return (xq.float() * xs) @ (w.float() * ws.reshape(-1, 1)).T, "emulated (dequantized FP8, float32 GEMM)", True


class _Fp8Block(_Fp8Dense):
    def quant(self, x, cols=None):
        return fp8_per_group_dequant(x)

    def check(self, mod, slices, problems) -> None:
        problems.expect_parts("weight", mod.weight, self.weights(slices))
        k = self.shards[0].out_in[1]
        problems.scalar("weight_scale", mod.weight_scale, torch.cat([
            self.src.cpu(m.tensors[WEIGHT_SCALE].name).reshape(-1, k // 128)[r0 // 128:r1 // 128, c0 // 128:c1 // 128]
            for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)]))

    def kernel(self, ck, mod, xr, rows):
        rows = torch.from_numpy(rows)
        dev_rows = rows.to(xr.device)
        s = mod.weight_scale.float()[dev_rows // 128].repeat_interleave(128, 1)
        return (fp8_per_group_dequant(xr) @ (rows_of(mod.weight, rows).float() * s).T,
                "emulated (dequantized FP8 128x128 blocks, float32 GEMM)", True)


CASES: dict[ModuleKind, type[_Fp8Dense]] = {
    ModuleKind.FP8_LINEAR: _Fp8Tensor, ModuleKind.FP8_CHANNEL_LINEAR: _Fp8Channel,
    ModuleKind.FP8_BLOCK_LINEAR: _Fp8Block,
}


def check(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext):
    kind = next(iter(infos.values())).kind
    return check_dense(name, infos, ctx, CASES[kind])
