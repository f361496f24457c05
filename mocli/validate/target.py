"""Target findings, on each rank's shapes: a stored scheme the target has no kernel path for
(TGT002), the target's alignment constraints per scheme (TGT001, ``TargetLayout.constraints``) and
the layers too small for the target's kernel (TGT003, a warning: ``TargetLayout.minimums``)."""

from __future__ import annotations

from mocli.census import Census
from mocli.findings import Findings
from mocli.parallel import Heads, ParallelLayout, rank_slices
from mocli.targets import Target, layout_of
from mocli.validate.parallel import sliceable_units


def check_target(target: Target, par: ParallelLayout, heads: Heads | None, census: Census,
                 sliceable: set[str], findings: Findings, mxfp4_experts: str = "native") -> None:
    layout = layout_of(target, mxfp4_experts)
    at = "" if par.single else f" per rank at tp {par.tp}" + (f", ep {par.ep}" if par.ep > 1 else "")
    for name, shards, scheme in sliceable_units(census):
        if scheme not in layout.supported["linear"]:
            findings.add("TGT002", name, f"{target} does not take {scheme} linears", hint=_elsewhere(scheme, "linear"))
            continue
        if name not in sliceable:
            continue
        sl = rank_slices(par, heads, shards)[0]
        for c in layout.constraints:
            if c.scope == "linear" and c.scheme is scheme:
                size = sl.n if c.dim == "N" else sl.k
                if size % c.multiple:
                    findings.add("TGT001", name, f"{c.dim} = {size}{at} is not a multiple of {c.multiple}",
                                 hint=c.why)
        for m in layout.minimums:
            size = sl.n if m.dim == "N" else sl.k
            if m.scheme is scheme and size < m.at_least:
                findings.add("TGT003", name, f"{m.dim} = {size}{at} is below {target}'s kernel minimum of "
                             f"{m.at_least}", hint=m.why)
    _check_moe(layout, par, census, findings, at)


def _check_moe(layout, par: ParallelLayout, census: Census, findings: Findings, at: str) -> None:
    target = layout.target
    for layer in census.moe:
        schemes = layer.schemes - {None}
        if not schemes:
            continue
        if len(schemes) > 1 or None in layer.schemes:
            findings.add("TGT002", layer.name, "experts are stored in mixed schemes "
                         f"({', '.join(sorted(str(s) for s in layer.schemes))})",
                         hint="the fused-MoE kernel takes one scheme per layer; re-export")
            continue
        scheme = schemes.pop()
        if scheme not in layout.supported["moe"]:
            findings.add("TGT002", layer.name, f"{target} has no fused-MoE path for {scheme} experts",
                         hint=_elsewhere(scheme, "moe"))
            continue
        if (why := layout.moe_refusal(layer)) is not None:
            findings.add("TGT002", layer.name, why, hint="serve the checkpoint as it is, or use a target that writes "
                         "these experts (mocli validate --target ... says which)")
            continue
        i, h = layer.intermediate, layer.hidden
        if i is None or h is None:
            continue
        i_rank = i if par.expert_parallel or i % par.tp else i // par.tp
        for c in layout.constraints:
            if c.scope == "moe" and c.scheme is scheme:
                size = 2 * i_rank if c.dim == "2I" else h
                if size % c.multiple:
                    findings.add("TGT001", layer.name, f"{c.dim} = {size}{at} is not a multiple of {c.multiple} "
                                 f"(I = {i_rank}, H = {h})", hint=c.why)


def _elsewhere(scheme, scope: str) -> str:
    """The hint of a scheme a target does not take: the targets that do, else a re-export."""
    from mocli.targets.base import NO_PATH

    takers = [str(t) for t in Target if scheme in layout_of(t).supported[scope]]
    if not takers and (scheme, scope) in NO_PATH:
        return NO_PATH[scheme, scope]
    if takers:
        return f"convert with --target {' or --target '.join(takers)}, which take{'s' if len(takers) == 1 else ''} {scheme}"
    return "no mocli target takes it: re-export in a scheme one takes (mocli validate --target T lists them)"
