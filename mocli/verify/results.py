"""What every verify check shares without torch: options, thresholds, results, problem lists and the
seeds of the activations each check draws. NVFP4 outputs are verified with numpy alone
(``mocli.verify.kinds``); the torch checks (FP8 kinds, ``quantized``, ``repaired``) use the
same pieces. Arrays are numpy arrays or torch tensors alike here."""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from mocli.devices import Kernels
from mocli.errors import CorruptFileError
from mocli.formats.manifest import ModuleEntry
from mocli.kinds import CARDS, ModuleKind, Thresholds
from mocli.targets.decode import LayoutError
from mocli.verify.expect import bit_equal, rule_slices, to_numpy


@dataclass
class VerifyOptions:
    source: str | None = None
    device: str = "auto"
    kernels: Kernels = Kernels.AUTO
    layers: str | None = None
    tokens: int = 64
    seed: int = 0
    rank: int | None = None
    check_source_hash: bool = True
    early_digests: Any = None  # a mocli.io.digests.BackgroundDigests started before torch (verify.early)


# Every kind of module verify reports, and its thresholds (``Thresholds``): each converted module kind's from
# its card (``mocli.kinds``), and the dynamic FP8 linears and experts ``mocli quantize`` writes (checked by
# ``verify.quantized``). Dynamic FP8: the weights (per tensor) and the activations (per token) are each
# rounded to e4m3 (3 mantissa bits: up to 2^-4 relative, rms about 2.6% each); measured 3.7% together on
# Gaussian weights with outliers. A 2x scale error is 0.5-1.0 and a swapped shard about 1.4.
QUANTIZED_THRESHOLDS: dict[str, Thresholds] = {"fp8_dynamic_linear": Thresholds(0.08, 0.08),
                                              "fp8_dynamic_moe": Thresholds(0.08, 0.08, gemm2=0.08)}
THRESHOLDS: dict[str, Thresholds] = {**{c.kind: c.thresholds for c in CARDS}, **QUANTIZED_THRESHOLDS}
# A fused FlashInfer MoE kernel gives only the layer output: the intermediate is re-quantized from
# slightly different values, so neighbouring codes flip (e2m1 codes are up to 33% apart).
FUSED_MOE_THRESHOLD = 0.10

# Numeric GEMMs per MoE layer. Every expert's bytes and scales are checked exactly regardless, so an
# expert's numbers follow from its bytes; the GEMMs exercise the kernel's reading of them (half order,
# scales, intermediate quantization), which a layer-wide fault breaks for every expert alike. Where
# one call covers every expert (FP8's grouped GEMM on CUDA) all run; where experts go one by one
# (emulated NVFP4) the first and seeded others.
CPU_SAMPLE_EXPERTS = 2
CUDA_SAMPLE_EXPERTS = 8


def seed_of(seed: int, name: str) -> int:
    """The seed of one check's random draws: the run's ``--seed`` and the module's name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(seed_of(seed, name))


def pick_experts(n: int, k: int, seed: int, name: str) -> list[int]:
    """Of ``n`` experts, the first and ``k - 1`` seeded others (all when ``n <= k``), the same on every
    rank (seeded by the layer's name)."""
    if n <= k:
        return list(range(n))
    rest = rng(seed, name + "/experts").permutation(n - 1)[: k - 1] + 1
    return sorted({0, *rest.tolist()})


def offsets_of(shards: list) -> list[int]:
    """Each shard's first row in the fused layer."""
    offs, off = [], 0
    for m in shards:
        offs.append(off)
        off += m.out_in[0]
    return offs


def rank_slices(info: ModuleEntry, shards: list, tp: int, heads, problems: Problems) -> tuple[list[list[int]], str]:
    """A dense module's rank: its [a, b, c0, c1] per shard as the manifest records them (whole tensors
    where it records none) and its split; a problem where they are not SEMANTICS §10's."""
    meta = info.meta
    slices = meta.get("slices") or [[0, m.out_in[0], 0, m.out_in[1]] for m in shards]
    expected = rule_slices(info.meta, shards, tp, heads)
    if expected is not None and expected != slices:
        problems.append(f"the manifest's slices {slices} are not SEMANTICS §10's {expected}")
    return slices, meta.get("split", "replicated")


NUMERIC_ROWS = 512  # output rows per dense module that get GEMMs (every row's bytes are compared)


def sample_rows(shards: list, offsets: list[int], seed: int, name: str) -> np.ndarray:
    """Full-layer output rows that get GEMMs: each shard's first and last row plus seeded others."""
    n = sum(m.out_in[0] for m in shards)
    if n <= NUMERIC_ROWS:
        return np.arange(n)
    edges = {int(e) for off, m in zip(offsets, shards, strict=True) for e in (off, off + m.out_in[0] - 1)}
    pick = rng(seed, name + "/rows").permutation(n)[: NUMERIC_ROWS - len(edges)]
    return np.array(sorted(edges | set(pick.tolist())))


@dataclass
class ModuleResult:
    module: str
    rank: int
    kind: str
    scheme: str
    kernel: str
    emulated: bool
    shape: dict[str, int]
    error: float
    threshold: float
    passed: bool
    seconds: float
    message: str = ""
    checks: dict[str, str] = field(default_factory=dict)  # bytes / consistency / numeric -> "ok" or why not
    stages: dict[str, float] = field(default_factory=dict)
    tensors: list[str] = field(default_factory=list)  # every tensor this check covered

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "tensors"}
        d["error"] = None if math.isnan(self.error) else self.error  # JSON has no NaN
        d["tensors_checked"] = len(self.tensors)
        return d


@dataclass
class CrossResult:
    """A cross-rank property of one module (SEMANTICS §10)."""

    module: str
    check: str
    error: float
    threshold: float
    passed: bool
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["error"] = None if math.isnan(self.error) else self.error
        return d


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN where ``out`` is not finite)."""
    out, ref = to_numpy(out).astype(np.float64), to_numpy(ref).astype(np.float64)
    if not np.isfinite(out).all():
        return math.nan
    diff = float(np.linalg.norm(out - ref))
    denom = float(np.linalg.norm(ref))
    return diff / denom if denom > 0 else diff


class Halves(NamedTuple):
    """Decoded rows as a view (``TargetLayout.moe_rows_halves``): ``parts[k]``'s leading dims, read in
    order, are the rows of the k-th half (one part where nothing is gated)."""

    parts: Any

    def rows(self) -> int:
        p = self.parts
        return p.shape[0] * (math.prod(p.shape[1:-1]) if p.shape[-1] else 0)


def _same_rows(view, rows) -> bool:
    """``rows`` ([n, cols]) has as many rows and columns as ``view``'s leading dims and last dim hold."""
    return rows.ndim == 2 and rows.shape[1] == view.shape[-1] and math.prod(rows.shape) == math.prod(view.shape)


class Problems(list):
    def expect_equal(self, what: str, got, want) -> None:
        if isinstance(got, Halves):
            self.expect_parts(what, got, [want])
        elif not bit_equal(got, want):
            self.append(f"{what} differs from the source")

    def expect_parts(self, what: str, got, parts: list) -> None:
        """``got`` equals ``parts`` stacked on dim 0, compared block by block (no concatenation; a
        ``Halves`` part by part, the source's rows shaped as its view: nothing copied)."""
        if isinstance(got, Halves):
            if got.rows() != sum(p.shape[0] for p in parts):
                self.append(f"{what} has {got.rows()} rows, the source gives {sum(p.shape[0] for p in parts)}")
            elif len(parts) != got.parts.shape[0] or not all(
                    _same_rows(g, p) and bit_equal(g, p.reshape(g.shape)) for g, p in zip(got.parts, parts, strict=True)):
                self.append(f"{what} differs from the source")
            return
        if got.shape[0] != sum(p.shape[0] for p in parts):
            self.append(f"{what} has {got.shape[0]} rows, the source gives {sum(p.shape[0] for p in parts)}")
            return
        row = 0
        for p in parts:
            if not bit_equal(got[row:row + p.shape[0]], p):
                self.append(f"{what} differs from the source")
                return
            row += p.shape[0]

    def scalar(self, what: str, got, want) -> None:
        """float32 values bit for bit (a scale is a promise to the kernel, not an approximation)."""
        g = to_numpy(got).astype(np.float32).reshape(-1)
        w = to_numpy(want).astype(np.float32).reshape(-1)
        if g.shape != w.shape or not np.array_equal(g.view(np.int32), w.view(np.int32)):
            self.append(f"{what} is {_few(g)}, SEMANTICS gives {_few(w)}")


def _few(t: np.ndarray) -> str:
    vals = [f"{v:.6g}" for v in t[:3].tolist()]
    return "[" + ", ".join(vals) + (", ...]" if t.size > 3 else "]") if t.size != 1 else vals[0]


def finish(res: ModuleResult, problems: list[str], t0: float) -> ModuleResult:
    numeric_ok = not math.isnan(res.error) and res.error <= res.threshold
    res.checks = {"bytes+consistency": "ok" if not problems else "; ".join(problems[:3])
                  + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""),
                  "numeric": "ok" if numeric_ok else ("not run" if res.kernel == "layout check" else
                                                      "output is not finite" if math.isnan(res.error) else
                                                      f"relative error {res.error:.3g} > {res.threshold:g}")}
    res.passed = numeric_ok and not problems
    if not res.passed:
        res.message = "; ".join(v for v in res.checks.values() if v != "ok")
    res.seconds = round(time.perf_counter() - t0, 4)
    return res


@contextmanager
def rank_check(results: list[ModuleResult], name: str, rank: int, info: ModuleEntry, kind: ModuleKind,
               threshold: float) -> Iterator[tuple[ModuleResult, Problems]]:
    """One module on one rank, as every converted kind's check runs it: a result from the manifest's
    entry, the problems found, a layout fault (the bytes break the layout) ending the check as a
    "layout check" failure first in the list; the result goes into ``results`` finished."""
    t0 = time.perf_counter()
    res = ModuleResult(name, rank, str(kind), info.scheme, "", False,
                       {k: v for k, v in info.meta.items() if isinstance(v, int)}, math.nan, threshold, False, 0.0,
                       tensors=list(info.tensors.values()))
    problems = Problems()
    try:
        yield res, problems
    except (LayoutError, CorruptFileError) as e:
        res.kernel = "layout check"
        problems.insert(0, str(e))
    results.append(finish(res, problems, t0))


def take_bytes(found: Future, problems: Problems) -> None:
    """The expert byte checks run beside the GEMMs: their differences, then their own layout fault
    raised, as when they ran first."""
    differ, fault = found.result()
    problems += differ
    if fault is not None:
        raise fault


class Stages:
    """An MoE check's stage errors (GEMM1, GEMM2, largest over the sampled experts; NaN sticks) and its
    worst stage relative to that stage's threshold, which the module's result reports."""

    def __init__(self, experts: int) -> None:
        self.errors: dict[str, float] = {"gemm1": 0.0, "gemm2": 0.0, "experts_numeric": experts}
        self.worst = (-1.0, math.nan, 1.0)  # (error / threshold, error, threshold)

    def add(self, stage: str, err: float, threshold: float) -> None:
        prev = self.errors[stage]
        self.errors[stage] = math.nan if math.isnan(err) or math.isnan(prev) else max(prev, err)
        ratio = math.inf if math.isnan(err) else err / threshold
        if ratio > self.worst[0]:
            self.worst = (ratio, err, threshold)

    def result(self) -> tuple[float, float]:
        """(error, threshold) of the worst stage."""
        return self.worst[1], self.worst[2]


@dataclass
class Tally:
    """What a single-rank check counted beside its modules: files hashed, tensors passed through, coverage."""

    files_checked: int
    file_problems: list
    kept: int
    problems: list
    tensors: int
    unchecked: list
    note: str = ""


def single_rank_report(out, src, target: str, device: str, opts, results: list[ModuleResult], tally: Tally,
                       t0: float) -> dict[str, Any]:
    """The report of an output with one rank and no cross-rank checks (quantize and repair outputs), in
    the shape of convert's, so renderers, JUnit and HTML read all three alike."""
    failed, t = [r for r in results if not r.passed], tally
    return {
        "output": str(out), "source": src.source.describe(), "target": target,
        "parallel": {"tp": 1, "ep": 1, "ranks": 1}, "ranks": [0], "device": device, "tokens": opts.tokens,
        "seed": opts.seed, "files": {"checked": t.files_checked, "problems": t.file_problems},
        "modules": [r.to_dict() for r in results], "cross_rank": [],
        "passthrough": {"checked": t.kept, "problems": t.problems},
        "coverage": {"tensors": t.tensors, "unchecked": t.unchecked, "note": t.note},
        "passed": len(results) - len(failed),
        "failed": len(failed) + len(t.file_problems) + len(t.problems) + len(t.unchecked),
        "ok": not (failed or t.file_problems or t.problems or t.unchecked), "seconds": round(time.perf_counter() - t0, 3),
    }
