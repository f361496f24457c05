"""SCL006: a scale the target's conversion computes that is not finite, from source scales that are.

A target precomputes values from the stored scales (alphas = input_scale x weight_scale_2, reciprocals of
input scales, Marlin's global scale weight_scale_2 x 2^119 / scale factor, SEMANTICS §13.5; trtllm's output
scales): finite inputs can overflow float32 on the way. The planner records every value it computes
(``ConvertPlan.computed``), so validate plans the conversion for the target and ranks asked and judges those
values, the very ones convert would write; convert refuses on the finding before anything is written, and
the stream runner checks the same values again as they are written (``mocli.stream.units.check_finite``).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from mocli.census import Census
from mocli.findings import Finding, Findings, few
from mocli.io.aside import Child, aside
from mocli.parallel import Heads, ParallelLayout
from mocli.stream.units import NOT_SCALES
from mocli.targets import Target

_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def check_computed(target: Target, parallel: ParallelLayout, heads: Heads | None, census: Census,
                   scales: dict[str, np.ndarray], findings: Findings, mxfp4_experts: str = "native", units: bool = True):
    """The conversion's plan (None where errors found so far leave nothing to plan), with an SCL006 per
    output tensor whose computed value is not finite, naming the tensor, its ranks, its sources and values.
    ``units=False``: a plan that is only judged here (``build_plan``)."""
    from mocli.plan import build_plan

    if findings.errors:
        return None
    plan = build_plan(census, scales, target, parallel, heads, mxfp4_experts, units)
    bad: dict[str, list] = {}  # output tensor name -> [(OutTensor, value, element or None, {source: value})]
    for key, v in plan.computed.items():
        flat = v.reshape(-1)
        off = np.flatnonzero(~np.isfinite(flat))
        if off.size:
            t = plan.tensors[key]
            bad.setdefault(t.name, []).append((t, float(flat[off[0]]), int(off[0]) if v.ndim else None,
                                               _sources(t.sources, scales)))
    _casts(plan, census, bad)
    for name, hits in bad.items():
        t, value, element, source = hits[0]
        ranks = sorted({h[0].group for h in hits if h[0].group})
        where = f" on {few(ranks, 3)}" if ranks else ""
        at = f" (element {element})" if element is not None else ""
        findings.add("SCL006", next(iter(source)) if source else name,
                     f"{target} computes {name}{where} = {value}{at}: {', '.join(t.transforms) or 'computed'}"
                     + (f" of {few([f'{n} = {v:g}' for n, v in source.items()], 2)}" if source else "")
                     + f", which overflows {_NAMES.get(t.dtype, t.dtype)}",
                     hint="the stored scales are finite but this target's arithmetic on them is not; convert for "
                          "another target, or re-calibrate the export (mocli never writes a non-finite scale)")
    return plan


@contextmanager
def computed_aside(target: Target | None, parallel: ParallelLayout, heads: Heads | None, census: Census,
                   scales: dict[str, np.ndarray], experts: str, keep_plan: bool) -> Iterator[Child | None]:
    """``check_computed``'s findings worked out in a forked child (``mocli.io.aside``) while the other checks
    run here: planning a 94,858-tensor checkpoint for marlin is ~0.5 s of ``validate --target marlin``'s
    ~2.2 on the 2-core build VM. Only where the plan itself is not wanted (the ``validate`` command; convert
    goes on with it) and a target is asked. The child's plan makes no units (``build_plan``)."""
    if target is None or keep_plan:
        yield None
        return

    def work() -> bytes:
        found = Findings()
        check_computed(target, parallel, heads, census, scales, found, experts, units=False)
        return pickle.dumps(list(found))

    with aside(work) as job:
        yield job


def aside_findings(job: Child) -> list[Finding] | None:
    """The child's SCL006 findings; None where it did not finish (the caller checks in this process, and
    raises what is wrong there)."""
    sent = job.result()
    return None if sent is None else pickle.loads(sent)


def _casts(plan, census: Census, bad: dict[str, list]) -> None:
    """Vectors a target stores narrower than the source (a float32 pre_quant_scale written in BF16, rounded to
    nearest even: ``mocli.ops.bf16_bytes``) overflow where the source is above BF16's largest value."""
    from mocli.io.safetensors_file import TensorReader
    from mocli.ops import bf16_bytes

    narrowed = [t for t in plan.tensors.values() if t.dtype == "BF16" and t.role not in NOT_SCALES]
    if not narrowed:  # most plans (a marlin plan of the 94,858-tensor bench: 0.07 s of name lookups spared)
        return
    entries = {e.name: e for m in census.modules.values() for e in m.tensors.values()}
    with TensorReader() as reader:
        for t in narrowed:
            for src in (entries[n] for n in t.sources if n in entries and entries[n].dtype == "F32"):
                stored = reader.array(src).reshape(-1)
                off = np.flatnonzero((bf16_bytes(stored, "F32") & 0x7F80) == 0x7F80)
                if off.size:
                    i = int(off[0])
                    bad.setdefault(t.name, []).append((t, float(np.copysign(np.inf, stored[i])), i,
                                                       {src.name: float(stored[i])}))
                    break


def _sources(names: list[str], scales: dict[str, np.ndarray]) -> dict[str, float]:
    """Source scale name -> its largest magnitude, the largest first (the one that overflowed, mostly)."""
    known = {n: float(np.abs(scales[n]).max()) for n in names if n in scales and scales[n].size}
    return dict(sorted(known.items(), key=lambda kv: -kv[1]))
