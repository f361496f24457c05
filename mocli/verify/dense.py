"""Dense FP8 linears of one converted module, per rank: bytes, scales, kernel numerics, cross-rank
(the checks ``mocli.plan.dense`` answers to). One check class per kind, in ``DENSE``; NVFP4 linears
are checked in numpy (``mocli.verify.nvfp4``)."""

from __future__ import annotations

import torch

from mocli.census import Module
from mocli.kinds import ModuleKind
from mocli.loader import ConvertedCheckpoint
from mocli.numerics import FP8_MAX
from mocli.numerics.in_torch import fp8_per_group_dequant, fp8_per_token, fp8_static
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE
from mocli.verify.common import (
    THRESHOLDS,
    CrossResult,
    ModuleResult,
    Problems,
    Runtime,
    Source,
    gen,
    rel_error,
    rows_of,
    scaled_mm,
)
from mocli.verify.cross import dense_cross
from mocli.verify.expect import apply_table, to_numpy
from mocli.verify.results import offsets_of, rank_check, rank_slices, sample_rows


class _DenseKind:
    """What differs between dense kinds: activation model, byte/scale expectations, the kernel."""

    threshold: float
    x_scale: float = 1.0

    def __init__(self, shards: list[Module], src: Source, rt: Runtime) -> None:
        self.shards, self.src, self.rt = shards, src, rt

    def quant(self, x: torch.Tensor) -> torch.Tensor:
        """The activations as the kernel quantizes them, dequantized (float32)."""
        raise NotImplementedError

    def check(self, mod, slices: list[list[int]], problems: Problems) -> None:
        raise NotImplementedError

    def kernel(self, mod, xr: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, str, bool]:
        """The kernel's output for the rank's output ``rows`` (local indices)."""
        raise NotImplementedError

    def weights(self, slices) -> list[torch.Tensor]:
        return [self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0:c1]
                for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)]


class _Fp8Linear(_DenseKind):
    threshold = THRESHOLDS[ModuleKind.FP8_LINEAR].kept

    def __init__(self, shards, src, rt) -> None:
        super().__init__(shards, src, rt)
        self.s = [src.scalar(m, WEIGHT_SCALE) for m in shards]
        self.big_s = torch.stack(self.s).max()
        self.big_a = torch.stack([src.scalar(m, INPUT_SCALE) for m in shards]).max()
        self.x_scale = float(self.big_a) * FP8_MAX / 4

    def quant(self, x):
        return fp8_static(x, self.big_a).float() * self.big_a.to(x.device)

    def check(self, mod, slices, problems) -> None:
        problems.scalar("weight_scale", mod.weight_scale, self.big_s)
        problems.scalar("input_scale", mod.input_scale, self.big_a)
        problems.expect_parts("weight", mod.weight, [
            apply_table("requant", self.src.cpu(m.tensors[WEIGHT].name)[r0:r1, c0:c1], si, self.big_s)
            for m, si, (r0, r1, c0, c1) in zip(self.shards, self.s, slices, strict=True)])

    def kernel(self, mod, xr, rows):
        xq = fp8_static(xr, mod.input_scale)
        out = scaled_mm(xq, rows_of(mod.weight, rows), mod.input_scale.float(), mod.weight_scale.float())
        return out, "torch._scaled_mm", False


class _Fp8Channel(_DenseKind):
    threshold = THRESHOLDS[ModuleKind.FP8_CHANNEL_LINEAR].kept

    def quant(self, x):
        q, s = fp8_per_token(x)
        return q.float() * s

    def check(self, mod, slices, problems) -> None:
        problems.expect_parts("weight", mod.weight, self.weights(slices))
        row_split = slices[0][2] != 0 or slices[0][3] != self.shards[0].out_in[1]
        scales = [self.src.cpu(m.tensors[WEIGHT_SCALE].name).reshape(-1) for m in self.shards]
        problems.scalar("weight_scale", mod.weight_scale, torch.cat(
            scales if row_split else [sc[r0:r1] for sc, (r0, r1, _, _) in zip(scales, slices, strict=True)]))

    def kernel(self, mod, xr, rows):
        xq, xs = fp8_per_token(xr)
        w, ws = rows_of(mod.weight, rows), mod.weight_scale.float()[rows.to(xr.device)]
        try:
            return scaled_mm(xq, w, xs, ws), "torch._scaled_mm (rowwise)", False
        except (RuntimeError, NotImplementedError):
            return (xq.float() * xs) @ (w.float() * ws.reshape(-1, 1)).T, "emulated (dequantized FP8, float32 GEMM)", True


class _Fp8Block(_DenseKind):
    threshold = THRESHOLDS[ModuleKind.FP8_BLOCK_LINEAR].kept

    def quant(self, x):
        return fp8_per_group_dequant(x)

    def check(self, mod, slices, problems) -> None:
        problems.expect_parts("weight", mod.weight, self.weights(slices))
        k = self.shards[0].out_in[1]
        problems.scalar("weight_scale", mod.weight_scale, torch.cat([
            self.src.cpu(m.tensors[WEIGHT_SCALE].name).reshape(-1, k // 128)[r0 // 128:r1 // 128, c0 // 128:c1 // 128]
            for m, (r0, r1, c0, c1) in zip(self.shards, slices, strict=True)]))

    def kernel(self, mod, xr, rows):
        dev_rows = rows.to(xr.device)
        s = mod.weight_scale.float()[dev_rows // 128].repeat_interleave(128, 1)
        return (fp8_per_group_dequant(xr) @ (rows_of(mod.weight, rows).float() * s).T,
                "emulated (dequantized FP8 128x128 blocks, float32 GEMM)", True)


DENSE: dict[ModuleKind, type[_DenseKind]] = {
    ModuleKind.FP8_LINEAR: _Fp8Linear, ModuleKind.FP8_CHANNEL_LINEAR: _Fp8Channel,
    ModuleKind.FP8_BLOCK_LINEAR: _Fp8Block,
}



def check_dense(name: str, infos: dict[int, dict], cks: dict[int, ConvertedCheckpoint], src: Source, rt: Runtime,
                opts, tp: int, heads) -> tuple[list[ModuleResult], CrossResult | None]:
    """One dense module on every given rank, then (all ranks given) the column-concat / row-sum
    property. Bytes are compared for every row; GEMMs run on up to NUMERIC_ROWS sampled rows."""
    first = next(iter(infos.values()))
    kind = ModuleKind(first["kind"])
    shards = [src.module(n) for n in first["sources"]]
    case = DENSE[kind](shards, src, rt)
    k_full = shards[0].out_in[1]
    x = (torch.randn(opts.tokens, k_full, generator=gen(opts.seed, name)) * case.x_scale).to(rt.device)
    offsets = offsets_of(shards)
    sample = torch.from_numpy(sample_rows(shards, offsets, opts.seed, name))  # sorted full-layer rows
    parts = []
    for m, off in zip(shards, offsets, strict=True):
        local = sample[(sample >= off) & (sample < off + m.out_in[0])] - off
        if len(local):
            parts.append(src.dequant(m, local))
    w_sample = torch.cat(parts)  # source weights of the sampled rows, float32 [S, K]
    bias_full = torch.cat([src.cpu(m.tensors["bias"].name) for m in shards]).float() if "bias" in shards[0].tensors \
        else None
    results, outs = [], {}
    xq_full = None
    for rank, info in infos.items():
        meta = info["meta"]
        with rank_check(results, name, rank, info, kind, case.threshold) as (res, problems):
            slices, split = rank_slices(info, shards, tp, heads, problems)
            mod = cks[rank].load_module(name, rt.device)
            case.check(mod, slices, problems)
            c0, c1 = slices[0][2], slices[0][3]
            held = torch.cat([torch.arange(a, b) + off for (a, b, _, _), off in zip(slices, offsets, strict=True)])
            keep = torch.isin(held, sample)
            local_rows = keep.nonzero().reshape(-1)  # the rank's rows (local) that were sampled
            global_rows = held[local_rows]
            cols = torch.searchsorted(sample, global_rows)  # their place among the sampled rows
            xr = x[:, c0:c1]
            out, res.kernel, res.emulated = case.kernel(mod, xr, local_rows)
            xq_r = case.quant(xr)
            if split == "row":
                ref = xq_r @ w_sample[:, c0:c1].to(xq_r.device).T
            else:
                if xq_full is None:  # the same for every rank; the rank's own when it holds every column
                    xq_full = xq_r if (c0, c1) == (0, k_full) else case.quant(x)
                ref = (xq_full @ w_sample.to(x.device).T)[:, cols.to(x.device)]
            if getattr(mod, "bias", None) is not None:
                problems.expect_parts("bias", mod.bias, [src.cpu(m.tensors["bias"].name)[a:e]
                                                         for m, (a, e, _, _) in zip(shards, slices, strict=True)])
                # the engine adds a row-parallel bias once, after the all-reduce: rank 0 carries it here
                if split != "row" or meta.get("tp_rank", 0) == 0:
                    out = out + mod.bias.float()[local_rows.to(out.device)]
                    ref = ref + bias_full.to(ref.device)[global_rows.to(ref.device)]
            res.error = rel_error(out, ref)
            outs[rank] = (split, cols, xq_r, out, meta.get("tp_rank", 0))
    cross = None
    if len(outs) > 1 and len(outs) == len(infos):  # in numpy (small arrays): one implementation for every kind
        np_outs = {r: (sp, c.numpy(), to_numpy(xq), to_numpy(o), t) for r, (sp, c, xq, o, t) in outs.items()}
        cross = dense_cross(name, np_outs, to_numpy(x), lambda a: to_numpy(case.quant(torch.from_numpy(a).to(rt.device))),
                            case.threshold, to_numpy(w_sample), None if bias_full is None else to_numpy(bias_full[sample]))
    return results, cross
