"""``mocli validate``: config, exclusions, tensor census, scale health, target and per-rank constraints.

Reads headers, plus the small float32 scale tensors (0-dim, per-channel, per-block) for scale health;
``deep`` also scans every weight and block-scale byte for NaN/Inf codes at disk speed. No torch
here: validate starts in a fraction of a second. Never prints; returns a report the CLI renders.
One module per finding family: ``exclusion`` (CFG006, EXC), ``tensor`` (TNS, SCL003), ``scale``
(SCL), ``parallel`` (PAR), ``target`` (TGT). What differs between stored schemes is asked of the
module's scheme (``mocli.schemes``), never branched on here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mocli.census import Census
from mocli.checkpoint import Checkpoint
from mocli.engines import ENGINES, Engine
from mocli.findings import Findings
from mocli.io.aside import Child
from mocli.io.bulk import paused_gc
from mocli.parallel import Heads, ParallelLayout
from mocli.scales import read_scales
from mocli.targets import Target
from mocli.validate.awq import check_awq
from mocli.validate.computed import aside_findings, check_computed, computed_aside
from mocli.validate.exclusion import check_exclusions, check_mixed_layers, declared_quantized
from mocli.validate.grouping import group_findings
from mocli.validate.mxfp4 import check_mxfp4
from mocli.validate.parallel import check_parallel
from mocli.validate.reencode import check_reencoded
from mocli.validate.scale import aside_scale_checks, check_scales, scales_aside
from mocli.validate.target import check_target
from mocli.validate.tensor import check_kv_cache, check_tensors


@dataclass
class ValidationReport:
    findings: Findings
    census: Census
    stats: dict[str, Any] = field(default_factory=dict)
    plan: Any = field(default=None, repr=False)  # the target's conversion plan, where one was judged (SCL006)

    # what was judged: the engines whose reading was checked, the target (None: none asked), tp, ep, --deep
    judged: dict[str, Any] = field(default_factory=dict)
    # what was asked, or could be, and was not judged: {"what": "engine" | "target" | "checkpoint", "name", "label",
    # "why"}
    not_judged: list[dict[str, Any]] = field(default_factory=list)
    ignored: int = 0  # findings --select/--ignore left out
    warnings_as_errors: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.findings.errors) or self.warnings_as_errors and bool(self.findings.warnings)

    @property
    def nothing_judged(self) -> bool:
        """No engine's reading was judged (--engine sglang on compressed-tensors, no quantization config):
        never reported as OK."""
        return not self.judged.get("engines")

    @property
    def ok(self) -> bool:
        return not self.failed and not self.nothing_judged

    @property
    def verdict(self) -> str:
        return "failed" if self.failed else "not judged" if self.nothing_judged else "ok"

    def filter(self, select: list[str], ignore: list[str]) -> None:
        """Keep the findings whose code starts with a ``select`` entry (all when empty) and with no
        ``ignore`` entry (ruff's --select/--ignore)."""
        sel = [c.upper() for c in select]
        ign = [c.upper() for c in ignore]
        kept = [f for f in self.findings if (not sel or f.code.startswith(tuple(sel))) and not f.code.startswith(tuple(ign))]
        self.ignored += len(self.findings) - len(kept)
        self.findings[:] = kept

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "judged": self.judged,
            "not_judged": self.not_judged,
            "errors": len(self.findings.errors),
            "warnings": len(self.findings.warnings),
            "ignored": self.ignored,
            "findings": [f.to_dict() for f in self.findings],
            # the findings folded per layer as the human table shows them, each with its count and locations
            "grouped": group_findings([f.to_dict() for f in self.findings]),
            "stats": self.stats,
        }


def validate(ckpt: Checkpoint, target: Target | None = None, census: Census | None = None,
             scales: dict[str, np.ndarray] | None = None, parallel: ParallelLayout | None = None,
             deep: bool = False, progress: Any = None, engine: Engine = Engine.VLLM,
             mxfp4_experts: str = "native", keep_plan: bool = True) -> ValidationReport:
    """All checks; ``census``/``scales`` may be passed in when the caller already has them. ``engine``:
    whose reading of exclusions and algorithms is checked (``mocli.engines``; vLLM's by default).
    ``mxfp4_experts``: how the target would write MXFP4 experts (``mocli.targets.experts``; fp8-block reads
    every MXFP4 expert's bytes to judge its blocks, TGT004). ``keep_plan``: the report keeps the target's
    conversion plan (``ValidationReport.plan``, which convert goes on with); without it, the plan may be made
    and judged in a forked child beside the other checks (``mocli.validate.computed.computed_aside``)."""
    if mxfp4_experts != "native":
        from mocli.targets.experts import check_choice

        check_choice(target, mxfp4_experts)
    with paused_gc():  # ~100k findings, scale arrays and plan objects, none cyclic (see paused_gc)
        report = _header_checks(ckpt, target, census, scales, parallel, deep, engine, str(mxfp4_experts), keep_plan)
    if deep and "scale_names" in report.stats:  # not where the checks stopped early (no quantization config)
        from mocli.deep_scan import scan

        report.stats["deep"] = scan(ckpt, report.findings, skip=set(report.stats.get("scale_names", ())),
                                    progress=progress, census=report.census)
    return report


def _header_checks(ckpt: Checkpoint, target: Target | None, census: Census | None, scales: dict[str, np.ndarray] | None,
                   parallel: ParallelLayout | None, deep: bool, engine: Engine, experts: str,
                   keep_plan: bool) -> ValidationReport:
    """Every check but the deep scan: headers, configs, the scales and (``target``) the conversion's plan."""
    findings = Findings(ckpt.config_findings)
    census = census or ckpt.census()
    report = ValidationReport(findings, census)
    quant = ckpt.quant
    parallel = parallel or ParallelLayout()
    engines = ENGINES[engine]
    report.judged = {"engine": str(engine), "engines": [], "labels": {}, "target": None if target is None else str(target),
                     "tp": parallel.tp, "ep": parallel.ep, "deep": deep}
    if experts != "native":
        report.judged["mxfp4_experts"] = experts
    if quant is None or quant.algo is None:  # CFG00x already says why; nothing else can be judged
        report.not_judged.append({"what": "checkpoint", "name": None, "label": "engines, target and layout",
                                  "why": "no quantization config mocli reads (the CFG findings say why)"})
        return report
    _judged_engines(report, ckpt, engines)
    if target is None:
        report.not_judged.append({"what": "target", "name": None, "label": "target constraints",
                                  "why": f"no --target given ({', '.join(t.value for t in Target)})"})
    heads = Heads.from_config(ckpt.config)
    with _children(target, parallel, heads, census, scales, deep, experts, keep_plan) as (scales, jobs):
        # vLLM's exclusion reading also tells the tensor checks which modules an engine quantizes
        declared = declared_quantized(quant, census, findings if "vllm" in engines else Findings(), ckpt.architecture)
        if "vllm" in engines:
            check_mixed_layers(quant, census, findings)
            check_exclusions(quant, census, declared, findings)
        if "sglang" in report.judged["engines"]:
            from mocli.engines import sglang

            sglang.check(sglang_config(ckpt), census, ckpt.architecture, findings)
        check_tensors(quant, census, declared, findings)
        check_kv_cache(quant, ckpt.tensors, findings)
        check_awq(quant, census, frozenset(report.judged["engines"]), findings)
        check_mxfp4(quant, census, frozenset(report.judged["engines"]), findings)
        _scales_and_target(report, target, parallel, heads, scales, deep, experts, jobs)
    if not keep_plan:
        report.plan = None
    return report


@contextmanager
def _children(target: Target | None, parallel: ParallelLayout, heads: Heads | None, census: Census,
              scales: dict[str, np.ndarray] | None, deep: bool, experts: str,
              keep_plan: bool) -> Iterator[tuple[dict[str, np.ndarray] | None, tuple[Child | None, Child | None]]]:
    """(the scales, (the plan's child, the scales' child)): work forked beside the checks. With a target, the
    scales are read first, so that a child judging its plan has them too (``computed_aside``); without one
    or the deep scan nothing here needs their values: a child reads and checks them (``scales_aside``)."""
    if scales is None and target is None and not deep:
        with scales_aside(census) as job:
            yield None, (None, job)
        return
    scales = scales if scales is not None else read_scales(census)
    with computed_aside(target, parallel, heads, census, scales, experts, keep_plan) as job:
        yield scales, (job, None)


def _scales_and_target(report: ValidationReport, target: Target | None, parallel: ParallelLayout, heads: Heads | None,
                       scales: dict[str, np.ndarray] | None, deep: bool, experts: str,
                       jobs: tuple[Child | None, Child | None]) -> None:
    """Scale health, the TP/EP layout, and the target's constraints and computed scales (SCL006: from
    the plan's child, where one was started and finished; scale health from the scales' child likewise)."""
    census, findings = report.census, report.findings
    job, scales_job = jobs
    checked = aside_scale_checks(scales_job) if scales_job is not None else None
    if checked is None:
        scales = scales if scales is not None else read_scales(census)
        report.stats["scales"] = check_scales(scales, census, findings)
    else:
        findings.extend(checked[0])
        report.stats["scales"] = checked[1]
    report.stats["scale_names"] = list(scales) if deep else []
    sliceable = check_parallel(parallel, heads, census, findings)
    if target is not None:
        check_target(target, parallel, heads, census, sliceable, findings, experts)
        check_reencoded(target, census, findings, experts)
        computed = aside_findings(job) if job is not None and not findings.errors else None
        if computed is not None:
            findings.extend(computed)
        else:
            report.plan = check_computed(target, parallel, heads, census, scales, findings, experts)


def _judged_engines(report: ValidationReport, ckpt: Checkpoint, engines: frozenset[str]) -> None:
    """The engines whose reading validate judges for this checkpoint (``mocli.engines.unjudged``: where
    one is asked but not restated, the reason goes to ``not_judged``)."""
    from mocli.engines import LABELS, ORDER, unjudged

    for name in sorted(engines, key=ORDER.index):
        why = unjudged(name, sglang_config(ckpt) if name == "sglang" else ckpt.quant)
        if why:
            report.not_judged.append({"what": "engine", "name": name, "label": LABELS[name], "why": why})
        else:
            report.judged["engines"].append(name)
            report.judged["labels"][name] = LABELS[name]


def sglang_config(ckpt: Checkpoint):
    """The settings as SGLang reads them: config.json's ``quantization_config`` first (vLLM reads
    hf_quant_config.json first), its quantized_layers from hf_quant_config.json where config.json has none."""
    from dataclasses import replace

    cj, hf = ckpt.config_quant, ckpt.hf_quant_config
    if cj is None or cj.algo is None:
        return hf if hf is not None and hf.algo is not None else ckpt.quant
    if hf is not None and not cj.quantized_layers and hf.quantized_layers:
        cj = replace(cj, quantized_layers=hf.quantized_layers)
    if hf is not None and cj.kv_cache_algo is None and hf.kv_cache_algo:  # a spelling mocli's parser did not take
        cj = replace(cj, kv_cache_algo=hf.kv_cache_algo)
    return cj


__all__ = ["ValidationReport", "sglang_config", "validate"]
