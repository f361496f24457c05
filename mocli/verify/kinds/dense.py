"""The per-rank check of a dense linear, written once for every dense kind, whatever library holds its
arrays (SEMANTICS §3, §6, §8, §10).

Per rank: the slices the manifest records against SEMANTICS §10, the kind's bytes and scales
(``DenseCase.check``), the kernel's output on sampled rows against the source's layer on the same
activations, the bias; then, with every rank given, the column-concat / row-sum property
(``mocli.verify.cross``, in numpy). Index arithmetic is numpy's; a case holds torch tensors (FP8) or
numpy arrays (NVFP4) and does its own arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mocli.census import Module
from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.verify.cross import dense_cross
from mocli.verify.kinds.context import CheckContext
from mocli.verify.results import (
    CrossResult,
    ModuleResult,
    offsets_of,
    rank_check,
    rank_slices,
    rel_error,
    sample_rows,
)
from mocli.verify.source import floats


class DenseCase:
    """One dense kind's side of the check."""

    threshold: float

    def __init__(self, kind: ModuleKind, shards: list[Module], ctx: CheckContext) -> None:
        self.kind, self.shards, self.ctx, self.src = kind, shards, ctx, ctx.src

    def draw(self, name: str, k: int) -> Any:
        """The check's activations [T, K]."""
        raise NotImplementedError

    def quant(self, x: Any, cols: tuple[int, int] | None = None) -> Any:
        """The activations (the layer's input columns ``cols``; None: all) as the kernel quantizes them,
        dequantized (float32)."""
        raise NotImplementedError

    def sampled_weights(self, offsets: list[int], sample: np.ndarray) -> Any:
        """The source layer's weights of the sampled rows, float32 [S, K]."""
        raise NotImplementedError

    def load(self, ck, name: str) -> Any:
        raise NotImplementedError

    def check(self, mod, slices: list[list[int]], problems) -> None:
        """Bytes and scales of the rank's module against the source."""
        raise NotImplementedError

    def kernel(self, ck, mod, xr: Any, rows: np.ndarray) -> tuple[Any, str, bool]:
        """(output, kernel, emulated) of the rank's module for its output ``rows`` (local indices)."""
        raise NotImplementedError

    def source_rows(self, m: Module, suffix: str, a: int, b: int) -> Any:
        raise NotImplementedError

    def stored_bias(self, ck, info: ModuleEntry, mod) -> Any:
        raise NotImplementedError

    def bias_full(self) -> Any:
        raise NotImplementedError

    def index(self, rows: np.ndarray) -> Any:
        """An index array in the case's library."""
        return rows

    def to_numpy(self, a: Any) -> np.ndarray:
        return a

    def from_numpy(self, a: np.ndarray) -> Any:
        return a


class NumpyDenseCase(DenseCase):
    """A dense case computed in numpy on the CPU (the emulated layouts): source rows, biases as float32 arrays."""

    def source_rows(self, m, suffix, a, b):
        return self.src.arr(m.tensors[suffix].name)[a:b]

    def stored_bias(self, ck, info, mod):
        return floats(mod.bias, ck.entry(info.tensors["bias"]).dtype)

    def bias_full(self):
        return np.concatenate([self.src.floats(m.tensors["bias"].name) for m in self.shards])


def check_dense(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext,
                case_of: type[DenseCase]) -> tuple[list[ModuleResult], CrossResult | None]:
    """One dense module on every given rank, then (all ranks given) the column-concat / row-sum
    property. Bytes are compared for every row; GEMMs run on up to NUMERIC_ROWS sampled rows."""
    first = next(iter(infos.values()))
    kind = first.kind
    shards = [ctx.src.module(n) for n in first.sources]
    case = case_of(kind, shards, ctx)
    run = _Run(name, case, shards)
    results, outs = [], {}
    for rank, info in infos.items():
        with rank_check(results, name, rank, info, kind, case.threshold) as (res, problems):
            with np.errstate(all="ignore"):  # a broken scale gives inf/NaN, which fails the check (no warning)
                outs[rank] = run.rank(rank, info, res, problems)
    cross = None
    if len(outs) > 1 and len(outs) == len(infos):
        with np.errstate(all="ignore"):
            cross = run.cross(outs)
    return results, cross


class _Run:
    """One module's draws and source reference, shared by its ranks."""

    def __init__(self, name: str, case: DenseCase, shards: list[Module]) -> None:
        self.name, self.case, self.shards, ctx = name, case, shards, case.ctx
        self.k_full = shards[0].out_in[1]
        self.x = case.draw(name, self.k_full)
        self.offsets = offsets_of(shards)
        self.sample = sample_rows(shards, self.offsets, ctx.opts.seed, name)  # sorted full-layer rows
        self.w_sample = case.sampled_weights(self.offsets, self.sample)
        self.bias = case.bias_full() if "bias" in shards[0].tensors else None
        self.xq_full = None  # the reference input of a column-parallel or replicated rank, the same for each

    def rank(self, rank: int, info: ModuleEntry, res: ModuleResult, problems) -> tuple:
        case, ctx, meta = self.case, self.case.ctx, info.meta
        slices, split = rank_slices(info, self.shards, ctx.tp, ctx.heads, problems)
        mod = case.load(ctx.cks[rank], self.name)
        case.check(mod, slices, problems)
        c0, c1 = slices[0][2], slices[0][3]
        held = np.concatenate([np.arange(a, b) + off for (a, b, _, _), off in zip(slices, self.offsets, strict=True)])
        local_rows = np.nonzero(np.isin(held, self.sample))[0]  # the rank's rows (local) that were sampled
        global_rows = held[local_rows]
        cols = np.searchsorted(self.sample, global_rows)  # their place among the sampled rows
        xr = self.x[:, c0:c1]
        out, res.kernel, res.emulated = case.kernel(ctx.cks[rank], mod, xr, local_rows)
        xq_r = case.quant(xr, (c0, c1))
        if split == "row":
            ref = xq_r @ self.w_sample[:, c0:c1].T
        else:
            if self.xq_full is None:  # the rank's own when it holds every column
                self.xq_full = xq_r if (c0, c1) == (0, self.k_full) else case.quant(self.x)
            ref = (self.xq_full @ self.w_sample.T)[:, case.index(cols)]
        if getattr(mod, "bias", None) is not None:
            problems.expect_parts("bias", mod.bias, [case.source_rows(m, "bias", a, e)
                                                     for m, (a, e, _, _) in zip(self.shards, slices, strict=True)])
            # the engine adds a row-parallel bias once, after the all-reduce: rank 0 carries it here
            if split != "row" or meta.get("tp_rank", 0) == 0:
                out = out + case.stored_bias(ctx.cks[rank], info, mod)[case.index(local_rows)]
                ref = ref + self.bias[case.index(global_rows)]
        res.error = rel_error(out, ref)
        return split, cols, xq_r, out, meta.get("tp_rank", 0)

    def cross(self, outs: dict) -> CrossResult:
        """``dense_cross`` in numpy (small arrays): one implementation for every kind."""
        case, n = self.case, self.case.to_numpy
        np_outs = {r: (sp, c, n(xq), n(o), t) for r, (sp, c, xq, o, t) in outs.items()}
        bias = None if self.bias is None else n(self.bias)[self.sample]
        return dense_cross(self.name, np_outs, n(self.x), lambda a: n(case.quant(case.from_numpy(a))),
                           case.threshold, n(self.w_sample), bias)
