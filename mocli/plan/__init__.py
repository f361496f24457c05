"""Convert's planner: every output tensor and every work unit, per rank, from headers and small scales.

Nothing here moves weight bytes. ``build_plan`` decides names, dtypes, shapes, roles and ranks;
``mocli.stream`` runs the units and writes each result straight to its place; ``mocli.formats.layout``
writes the manifest. Layouts follow SEMANTICS §3-§8, per rank §10; scalar scale arithmetic is
float32 on the CPU (numpy: planning never loads torch, so the engine starts copying while it loads).
A module kind's planner is named by its card (``mocli.kinds.CARDS``); ``PLANNERS`` loads them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mocli.census import Census
from mocli.kinds import ModuleKind, table
from mocli.parallel import Heads, ParallelLayout
from mocli.plan.context import PlanContext
from mocli.plan.core import ConvertedModule, ConvertPlan
from mocli.plan.mxfp4_fp8block_moe import _Mxfp4Fp8BlockMoe
from mocli.schemes import MXFP4, Scheme
from mocli.targets import Target, layout_of

# Module kind -> its planner (its card's, ``mocli.kinds``), called as
# PLANNERS[kind](context, kind, name, modules or MoE layer).plan().
PLANNERS: dict[ModuleKind, Callable] = table("planner")
# (kind, stored scheme) -> the planner that writes that scheme as the kind by re-encoding it (a layout variant
# maps the scheme to the kind: ``mocli.targets.experts``)
REENCODED: dict[tuple[ModuleKind, Scheme], Callable] = {(ModuleKind.FP8_BLOCK_MOE, MXFP4): _Mxfp4Fp8BlockMoe}

__all__ = ["PLANNERS", "ConvertPlan", "ConvertedModule", "build_plan"]


def build_plan(census: Census, scales: dict[str, np.ndarray], target: Target,
               parallel: ParallelLayout | None = None, heads: Heads | None = None,
               mxfp4_experts: str = "native", units: bool = True) -> ConvertPlan:
    """The whole conversion: quantized dense modules and MoE layers through their kind's planner,
    everything else passed through unchanged at the top level (SEMANTICS §10: not sliced).
    ``mxfp4_experts``: how MXFP4 experts are written (``mocli.targets.experts``). ``units=False``: a plan
    to judge, not to run (``PlanContext.units``)."""
    pc = PlanContext(census, scales, layout_of(target, mxfp4_experts), parallel or ParallelLayout(), heads,
                     units=units)
    # a value that overflows is not a warning here: every computed one is judged (``ConvertPlan.computed``)
    with pc.reader, np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for name, shards, scheme in census.dense_units():
            _plan(pc, pc.layout.kind_for(scheme, moe=False), name, shards, scheme)
        for layer, scheme in census.moe_units():
            _plan(pc, pc.layout.kind_for(scheme, moe=True), layer.name, layer, scheme)
    if units:  # a plan only judged computes nothing more from what is copied as it is
        rest = [e for m in census.modules.values() for e in m.tensors.values() if e.name not in pc.consumed]
        pc.plan.copy_units(sorted(rest + census.kv_scales, key=lambda e: (str(e.file), e.start)))
    return pc.plan


def _plan(pc: PlanContext, kind: ModuleKind | None, name: str, what, scheme) -> None:
    if kind is None:  # validate refuses these first (TGT002); reaching here is a mocli bug
        raise ValueError(f"{name}: no kernel path for its scheme")
    REENCODED.get((kind, scheme), PLANNERS[kind])(pc, kind, name, what).plan()
