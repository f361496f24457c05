"""The per-rank check of a fused MoE layer, written once for every MoE kind, whatever library holds its
arrays (SEMANTICS §4, §7, §10).

Per rank: every scale vector against the source's (``MoeCase.consistency``), every expert's bytes
after the target's inverse transforms (beside the GEMMs, on a thread of their own), and stage-wise
numerics on sampled experts: GEMM1 (x @ [w3; w1]) against the source, GEMM2 fed with the kernel's own
quantized intermediate, so saturation of the intermediate format (a property of the scales, not of
the layout) cannot read as a fault; or FlashInfer's fused kernel end to end. Then, tensor parallel
with every rank given, the concatenation / sum over ranks (``mocli.verify.cross``, in numpy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from mocli import trace
from mocli.errors import CorruptFileError
from mocli.formats.manifest import ModuleEntry
from mocli.kinds import ModuleKind
from mocli.targets.decode import LayoutError
from mocli.verify.cross import moe_cross
from mocli.verify.kinds import byte_checks, each_expert
from mocli.verify.kinds.context import CheckContext
from mocli.verify.results import THRESHOLDS, CrossResult, ModuleResult, Problems, rank_check, take_bytes


class MoeCase:
    """One MoE kind's side of the check, for one layer."""

    kind: ModuleKind

    def __init__(self, name: str, ctx: CheckContext) -> None:
        self.name, self.ctx, self.src = name, ctx, ctx.src
        self.layer = ctx.src.layers[name]
        self.limits = THRESHOLDS[self.kind]

    def context(self, infos: dict[int, ModuleEntry]) -> contextlib.AbstractContextManager:
        """Held while the ranks are checked (FP8 on CUDA: the layer's source bytes on the device)."""
        return contextlib.nullcontext()

    def load(self, ck) -> Any:
        raise NotImplementedError

    def consistency(self, mod, experts: list, problems) -> None:
        raise NotImplementedError

    # the expert bytes (numpy kinds): one expert's check, what is done with all of them, where they run
    errors: tuple[type[Exception], ...] = (LayoutError, CorruptFileError)  # a layout fault: ends the bytes
    bytes_threads = "mocli-verify-bytes"

    def expert_bytes(self, mod, i_slice: tuple[int, int]) -> Callable[[int, Any, Problems], Any]:
        """``one(local, expert, found)``: one expert's bytes of a rank against the source, differences into
        ``found``, a layout fault raised (one of ``errors``); what it returns goes to ``bytes_found``."""
        raise NotImplementedError

    def bytes_found(self, mod, found: Problems, fault: Exception | None,
                    got: list) -> tuple[Problems, Exception | None]:
        """Every expert's bytes checked (``got``: what each ``one`` returned, up to a fault): the rank's findings."""
        return found, fault

    def all_bytes(self, mod, experts: list, i_slice: tuple[int, int]) -> Future:
        """Every expert's bytes of one rank, as a future of (differences, layout fault or None): on a
        thread beside the GEMMs."""
        return byte_checks(self.bytes_threads).submit(self.experts_bytes, mod, experts, i_slice)

    def experts_bytes(self, mod, experts: list, i_slice: tuple[int, int]) -> tuple[Problems, Exception | None]:
        trace.mark(f"{self.name}: expert bytes started")
        found = self.bytes_found(mod, *each_expert(experts, self.expert_bytes(mod, i_slice), self.errors))
        trace.mark(f"{self.name}: expert bytes done")
        return found

    def numbers(self, ck, mod, off: int, i_slice: tuple[int, int]) -> tuple:
        """(kernel, emulated, stage errors, (error, threshold), per-expert outputs or None)."""
        raise NotImplementedError

    def numpy_outs(self, outs: dict) -> dict:
        """Per-expert outputs as numpy arrays, for ``moe_cross``."""
        return outs

    def reference(self, gid: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source expert's full GEMM1 of the reference input ([up | gate]) and its GEMM2 of ``h``."""
        raise NotImplementedError


def rank_view(case: MoeCase, ck, info: ModuleEntry) -> tuple[Any, int, tuple[int, int], list]:
    """One rank's side of a layer: its arrays, its first expert's global index, its intermediate slice
    and its source experts."""
    meta = info.meta
    mod = case.load(ck)
    off = meta.get("expert_offset", 0)
    i_slice = tuple(meta.get("intermediate_slice", [0, meta["intermediate"]]))
    return mod, off, i_slice, [case.layer.experts[off + e] for e in range(mod.experts)]


def check_moe(name: str, infos: dict[int, ModuleEntry], ctx: CheckContext,
              case_of: type[MoeCase]) -> tuple[list[ModuleResult], CrossResult | None]:
    """One MoE layer on every given rank: bytes of every expert, consistency, stage-wise numerics on a
    sample of experts; then (tensor parallel, all ranks) the concatenation / sum over ranks. With
    ``ctx.pieces`` (``mocli.verify.pieces``) the expert bytes and the numerics run in worker processes,
    in pieces, the rest here."""
    case = case_of(name, ctx)
    pieces = ctx.pieces if ctx.pieces is not None and type(case).expert_bytes is not MoeCase.expert_bytes else None
    results, per_rank = [], {}
    with case.context(infos):
        for rank, info in infos.items():
            with rank_check(results, name, rank, info, case.kind, 0.0) as (res, problems):
                mod, off, i_slice, experts = rank_view(case, ctx.cks[rank], info)
                case.consistency(mod, experts, problems)
                found, later = pieces.start(case, case_of, rank, mod, experts, i_slice) if pieces else \
                    (case.all_bytes(mod, experts, i_slice), None)
                try:
                    numbers = later.result() if later else case_numbers(case, ctx.cks[rank], mod, off, i_slice)
                finally:
                    take_bytes(found, problems)
                res.kernel, res.emulated, res.stages, (res.error, res.threshold), outs = numbers
                if outs is not None:
                    per_rank[rank] = (i_slice, outs)
    cross = None
    if len({i_slice for i_slice, _ in per_rank.values()}) > 1 and len(per_rank) == len(infos):
        np_rank = {r: (sl, case.numpy_outs(outs)) for r, (sl, outs) in per_rank.items()}
        with np.errstate(all="ignore"):
            cross = moe_cross(name, np_rank, case.reference, case.layer.intermediate, case.limits)
    return results, cross


def case_numbers(case: MoeCase, ck, mod, off: int, i_slice: tuple[int, int]) -> tuple:
    with np.errstate(all="ignore"):  # a broken scale gives inf/NaN, which fails the check
        return case.numbers(ck, mod, off, i_slice)


def done(value) -> Future:
    """A future already holding ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f
