"""Cross-rank properties of a module (SEMANTICS §10), in numpy, for every kind: the ranks' kernel
outputs combined as the engine combines them, against the whole layer computed from the source.
The torch checks hand their (small) outputs over as numpy arrays."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mocli.verify.results import CrossResult, Thresholds, rel_error


def dense_cross(name: str, outs: dict, x: np.ndarray, quant: Callable[[np.ndarray], np.ndarray], threshold: float,
                w_sample: np.ndarray, bias_sample: np.ndarray | None) -> CrossResult:
    """Combine the ranks' kernel outputs as the engine does and compare with the whole layer (on the
    sampled rows). Ranks that share a tp rank (expert-parallel replicas) must agree and count once.
    ``outs``: rank -> (split, sampled columns, quantized input, kernel output, tp rank); ``quant``: the
    kind's activation model."""
    split = next(iter(outs.values()))[0]
    by_tp: dict[int, tuple] = {}
    for rank in sorted(outs):
        _, cols, xq, out, t = outs[rank]
        if t in by_tp and not np.array_equal(by_tp[t][2], out):
            return CrossResult(name, "replica ranks agree", math.nan, 0.0, False,
                               f"ranks holding tp rank {t} give different outputs")
        by_tp.setdefault(t, (cols, xq, out))
    if split == "row":
        check = "row-parallel rank outputs sum to the full layer"
        got = sum(out for _, _, out in by_tp.values())
        # ranks hold consecutive column blocks in tp-rank order; their quantized inputs side by side
        ref = np.concatenate([by_tp[t][1] for t in sorted(by_tp)], axis=1) @ w_sample.T
    else:
        check = ("column-parallel rank outputs concatenate to the full layer" if split == "column"
                 else "replicated ranks each equal the full layer")
        got = np.full((x.shape[0], w_sample.shape[0]), np.nan, dtype=np.float32)
        for cols, _, out in by_tp.values():
            held = ~np.isnan(got[:, cols])
            if held.any() and not np.array_equal(got[:, cols][held], out[held]):
                return CrossResult(name, check, math.nan, threshold, False, "replicated rows differ between ranks")
            got[:, cols] = out
        ref = quant(x) @ w_sample.T
    if bias_sample is not None:  # the ranks' outputs carry the bias (row-parallel: rank 0 only)
        ref = ref + bias_sample
    err = math.nan if np.isnan(got).any() else rel_error(got, ref)
    passed = not math.isnan(err) and err <= threshold
    return CrossResult(name, check, err, threshold, passed, "" if passed else
                       ("some rows are held by no rank" if math.isnan(err) else f"relative error {err:.3g} > "
                        f"{threshold:g}"))


def moe_cross(name: str, per_rank: dict, reference: Callable[[int, np.ndarray], tuple], inter: int,
              limits: Thresholds) -> CrossResult:
    """Tensor-parallel MoE: rank GEMM1 outputs concatenate to the full expert's, GEMM2 outputs sum to
    the full down projection of the concatenated intermediate (SEMANTICS §10). ``per_rank``: rank ->
    (its intermediate slice, global expert -> (GEMM1 out, GEMM2 out, intermediate)); ``reference(gid,
    h)``: the source expert's full GEMM1 of the reference input ([up | gate]) and its GEMM2 of ``h``."""
    worst = 0.0
    common = set.intersection(*(set(outs) for _, outs in per_rank.values()))
    for gid in sorted(common):
        h_parts = [per_rank[rank][1][gid][2] for rank in sorted(per_rank)]
        full1, ref2 = reference(gid, np.concatenate(h_parts, axis=1))
        got1 = np.empty_like(full1)
        total2 = 0
        for rank in sorted(per_rank):
            (i0, i1), outs = per_rank[rank]
            o1, o2, _ = outs[gid]
            i = i1 - i0
            got1[:, i0:i1], got1[:, inter + i0:inter + i1] = o1[:, :i], o1[:, i:]
            total2 = total2 + o2
        errs = (rel_error(got1, full1) / limits.unified, rel_error(total2, ref2) / limits.gemm2)
        worst = math.nan if math.isnan(worst) or any(map(math.isnan, errs)) else max(worst, *errs)
    passed = worst <= 1.0  # False for NaN
    return CrossResult(name, "tensor-parallel experts: GEMM1 concatenates, GEMM2 sums over ranks", worst, 1.0, passed,
                       "" if passed else f"error {worst:.3g}x the threshold")
