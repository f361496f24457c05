"""Plan a conversion from headers and small scales: every output tensor and every work unit.

Nothing here moves weight bytes. ``build_plan`` decides names, dtypes, shapes, roles and ranks;
``mocli.engine`` runs the units and writes each result straight to its place.
Layouts follow SEMANTICS §3-§8, per rank §10; scalar scale arithmetic is float32 on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from mocli.census import Census, Kind
from mocli.checkpoint import LAYOUT_MANIFEST
from mocli.parallel import Heads, ParallelLayout
from mocli.plan.context import PlanContext
from mocli.plan.core import (
    BadData,
    BufferPool,
    ConvertedModule,
    Key,
    OutTensor,
    Piece,
    Plan,
    SourceRange,
    Unit,
    UnitContext,
)
from mocli.plan.dense import plan_dense
from mocli.plan.moe import plan_moe
from mocli.plan.passthrough import plan_passthrough
from mocli.targets import Target, layout_of

LAYOUT_VERSION = 1
MANIFEST_NAME = LAYOUT_MANIFEST

__all__ = ["LAYOUT_VERSION", "MANIFEST_NAME", "BadData", "BufferPool", "ConvertedModule", "Key", "OutTensor",
           "Piece", "Plan", "SourceRange", "Unit", "UnitContext", "build_plan", "convert_manifest"]


def build_plan(census: Census, scales: dict[str, torch.Tensor], target: Target,
               parallel: ParallelLayout | None = None, heads: Heads | None = None) -> Plan:
    parallel = parallel or ParallelLayout()
    pc = PlanContext(census, scales, layout_of(target), parallel, heads)
    pc.plan.repairs = {"fp8_requantized_shards": 0, "nvfp4_rescaled_shards": 0, "nvfp4_rescaled_experts": 0,
                       "nvfp4_worst_scale_2_ratio": 1.0}
    for g in census.fused:
        schemes = {m.scheme for m in g.shards}
        if len(schemes) == 1 and None not in schemes:
            plan_dense(pc, g.name, g.shards, schemes.pop())
    for m in census.modules.values():
        if m.scheme is not None and m.kind is Kind.LINEAR:
            plan_dense(pc, m.name, [m], m.scheme)
    for layer in census.moe:
        plan_moe(pc, layer)
    rest = [e for m in census.modules.values() for e in m.tensors.values() if e.name not in pc.consumed]
    plan_passthrough(pc.plan, rest + census.kv_scales)
    return pc.plan


def convert_manifest(plan: Plan, target: Target, parallel: ParallelLayout) -> dict[str, Any]:
    """The mocli-layout.json body (LAYOUT.md): modules and tensors per rank, shared tensors once."""

    def tensors(group: str) -> dict[str, Any]:
        return {t.name: t.to_dict() for t in plan.tensors.values() if t.group == group}

    def modules(group: str) -> list[dict[str, Any]]:
        return [m.to_dict() for m in plan.modules if m.group == group]

    body: dict[str, Any] = {"format": "mocli-layout", "layout_version": LAYOUT_VERSION, "target": str(target),
                            "parallel": parallel.to_dict(), "modules": modules(""), "tensors": tensors("")}
    if not parallel.single:
        body["ranks"] = [{"rank": r, "tp_rank": parallel.tp_rank(r), "dir": parallel.group(r),
                          "modules": modules(parallel.group(r)), "tensors": tensors(parallel.group(r))}
                         for r in range(parallel.ranks)]
    return body
