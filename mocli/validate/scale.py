"""Scale health: every scale finite and positive (SCL001, SCL002), and the scales engines merge across
fused shards and an expert's w1/w3 (SCL004: an FP8 spread that requantization pays for; SCL005: NVFP4
global scales that differ, which engines silently mis-scale). Which scale a scheme merges, and how,
is the scheme's (``Scheme.merge``)."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mocli.census import Census, Module
from mocli.findings import Finding, Findings
from mocli.io.aside import Child, aside
from mocli.scales import read_scales
from mocli.schemes import Merge, distinct

# Requantizing an FP8 shard to a max scale this many times larger pushes its small values three
# binades down, into e4m3's subnormal range, where they lose mantissa bits (SEMANTICS §3).
SCALE_SPREAD_WARN = 8.0


def check_scales(values: dict[str, np.ndarray], census: Census, findings: Findings) -> dict[str, Any]:
    """NaN/Inf/non-positive scales, FP8 shard spread, NVFP4 weight_scale_2 mismatch. Returns stats."""
    _check_scale_values(values, findings)
    return _check_merged_scales(values, census, findings)


@contextmanager
def scales_aside(census: Census) -> Iterator[Child | None]:
    """The scales read and ``check_scales`` run in a forked child (``mocli.io.aside``) while the other checks
    run here, for a caller that needs only the findings and stats (validate without a target or the deep
    scan): ~0.26 of the ~0.56 s that followed the census of the 94,858-tensor checkpoint on 2 cores."""
    def work() -> bytes:
        found = Findings()
        stats = check_scales(read_scales(census), census, found)
        return pickle.dumps((list(found), stats))

    with aside(work) as job:
        yield job


def aside_scale_checks(job: Child) -> tuple[list[Finding], dict[str, Any]] | None:
    """The child's (findings, stats); None where it did not finish (the caller reads and checks here, and
    raises what is wrong there)."""
    sent = job.result()
    return None if sent is None else pickle.loads(sent)


def _check_scale_values(values: dict[str, np.ndarray], findings: Findings) -> None:
    """SCL001/SCL002: every scale finite and positive."""
    names = list(values)
    if names:
        # One vectorized pass over every scale, then a look at the few arrays that failed it.
        flat = np.concatenate([values[n].reshape(-1) for n in names])
        sizes = np.fromiter((values[n].size for n in names), dtype=np.int64, count=len(names))
        owner = np.repeat(np.arange(len(names)), sizes)
        # (``owner`` is sorted: its failing entries deduplicated in order. ``np.unique`` imported numpy.ma for
        # this, 5 ms of every convert and validate)
        bad = owner[~(np.isfinite(flat) & (flat > 0))].tolist()
        for i in dict.fromkeys(bad):
            v = values[names[i]]
            if not np.isfinite(v).all():
                findings.add("SCL001", names[i], f"contains {'NaN' if np.isnan(v).any() else 'Inf'}",
                             hint="the export is broken; re-run calibration")
            else:
                findings.add("SCL002", names[i], f"has a non-positive value ({float(v.min()):.3g})",
                             hint="dequant scales must be > 0")


def merged_groups(census: Census) -> list[tuple[str, str, list[Module | None]]]:
    """(name, what, shards) of every set of shards an engine merges into one scale: fused groups, and
    each expert's w1/w3."""
    groups: list[tuple[str, str, list[Module | None]]] = [(g.name, g.fused, list(g.shards)) for g in census.fused]
    for layer in census.moe:
        for e in sorted(layer.experts):
            ex = layer.experts[e]
            groups.append((f"{layer.name}.{e}", "w1/w3", [ex.gate, ex.up]))
    return groups


def _scalar(values: dict[str, np.ndarray], m: Module | None, suffix: str) -> float | None:
    t = m.tensors.get(suffix) if m else None
    v = values.get(t.name) if t else None
    if v is None or v.size != 1:
        return None
    x = float(v.reshape(-1)[0])
    return x if math.isfinite(x) and x > 0 else None


def _check_merged_scales(values: dict[str, np.ndarray], census: Census, findings: Findings) -> dict[str, Any]:
    """SCL004/SCL005 over the shards an engine merges into one scale (fused groups, an expert's w1/w3)."""
    stats: dict[str, Any] = {"fp8_groups": 0, "fp8_max_spread": 1.0,
                             "nvfp4_groups": 0, "nvfp4_scale2_mismatched": 0, "nvfp4_worst_ratio": 1.0}
    spread: dict[str, list[tuple[str, float]]] = {}
    mismatch: dict[str, list[tuple[str, float]]] = {}
    for name, kind, mods in merged_groups(census):
        schemes = distinct(m.scheme for m in mods if m is not None)
        scheme = schemes[0] if len(schemes) == 1 else None
        if scheme is None or scheme.merge is Merge.NONE:
            continue
        vals = [_scalar(values, m, scheme.merged_scale) for m in mods]
        if any(v is None for v in vals):
            continue
        ratio = max(vals) / min(vals)
        layer = name.rpartition(".")[0] if kind == "w1/w3" else kind
        if scheme.merge is Merge.REQUANTIZE:
            stats["fp8_groups"] += 1
            stats["fp8_max_spread"] = max(stats["fp8_max_spread"], ratio)
            if ratio > SCALE_SPREAD_WARN:
                spread.setdefault(layer, []).append((name, ratio))
        else:
            stats["nvfp4_groups"] += 1
            if ratio != 1.0:
                stats["nvfp4_scale2_mismatched"] += 1
                stats["nvfp4_worst_ratio"] = max(stats["nvfp4_worst_ratio"], ratio)
                mismatch.setdefault(layer, []).append((name, ratio))
    _report_merged(spread, mismatch, findings)
    return stats


def _report_merged(spread: dict[str, list[tuple[str, float]]], mismatch: dict[str, list[tuple[str, float]]],
                   findings: Findings) -> None:
    for layer, items in spread.items():
        worst = max(items, key=lambda x: x[1])
        findings.add("SCL004", worst[0] if len(items) == 1 else layer,
                     f"{len(items)} {'group' if len(items) == 1 else 'groups'} with weight_scale spread > "
                     f"{SCALE_SPREAD_WARN:g}x, worst {worst[1]:.1f}x ({worst[0]})",
                     hint="requantizing to the max scale will cost the smaller shards precision")
    for layer, items in mismatch.items():
        worst = max(items, key=lambda x: x[1])
        findings.add("SCL005", layer if len(items) > 1 else worst[0],
                     f"{len(items)} {'pair' if len(items) == 1 else 'groups'} with differing weight_scale_2, "
                     f"worst ratio {worst[1]:.3g}x ({worst[0]})",
                     hint="engines keep one value and silently mis-scale the other; mocli repair and convert "
                          "rescale instead (SEMANTICS §7, §11)")
