"""``mocli verify`` of a checkpoint written by ``mocli quantize`` (SEMANTICS §12).

Bytes: every quantized weight and scale equals verify's own evaluation of §12 on the unquantized
source (group amax, s = amax/448, fp8(clamp(w * (1/s), ±448))), every kept tensor equals the
source. Numerics: ``torch._scaled_mm`` with per-token dynamic activation scales against a float32
reference from the unquantized source; MoE layers stage by stage on each checked expert (GEMM1
against the source, GEMM2 on the kernel's own quantized intermediate).
"""

from __future__ import annotations

import math
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mocli.census import Census, Module
from mocli.checkpoint import Checkpoint, open_checkpoint
from mocli.errors import InputError
from mocli.numerics import FP8_MAX
from mocli.numerics.in_torch import FP8, fp8_per_token
from mocli.tables import WEIGHT, WEIGHT_SCALE
from mocli.verify.common import (
    THRESHOLDS,
    ModuleResult,
    Problems,
    Runtime,
    Tally,
    finish,
    gen,
    rel_error,
    runtime,
    sample_experts,
    scaled_mm,
    single_rank_report,
)
from mocli.verify.files import Hashes, compare_bytes, open_source


@lru_cache(maxsize=64)
def _table(dtype: torch.dtype, inv: float) -> torch.Tensor:
    """fp8 bytes of every 16-bit value under §12 (verify's own evaluation of the formula)."""
    vals = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).float()
    return (vals * torch.tensor(inv, dtype=torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def expected_fp8(w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    if w.dtype in (torch.bfloat16, torch.float16):
        return _table(w.dtype, float(inv))[w.contiguous().view(torch.int16).reshape(-1).int() & 0xFFFF].reshape(w.shape)
    return (w.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def _groups(out_census: Census) -> list[list[str]]:
    """Modules that share one scale under §12, as stored in the output (FP8 weights)."""
    fp8 = {m.name for m in out_census.modules.values() if m.scheme is not None}
    groups = [[m.name for m in g.shards] for g in out_census.fused if all(m.name in fp8 for m in g.shards)]
    for layer in out_census.moe:
        for e in sorted(layer.experts):
            ex = layer.experts[e]
            groups += [[ex.gate.name, ex.up.name], [ex.down.name]]
    grouped = {n for g in groups for n in g}
    groups += [[n] for n in sorted(fp8 - grouped)]
    return groups


def verify_quantized(out: Path, opts, progress) -> dict[str, Any]:
    t_all = time.perf_counter()
    ckpt = open_checkpoint(out)
    if ckpt.quant is None or ckpt.quant.method != "fp8":
        raise InputError(f"{out}: not a checkpoint mocli quantize wrote", hint="verify takes mocli convert or quantize output")
    from mocli.formats.fp8 import provenance_of

    prov = provenance_of(out) or {}
    src = open_source(out, prov, opts)
    shards = prov.get("output_shards")
    wanted = dict(shards) if isinstance(shards, dict) else None
    hashes = Hashes(out, wanted, prov.get("source_shards") or {}, src, opts, record_name="config.json")
    rt = runtime(opts, None)
    out_census = ckpt.census()
    groups = [g for g in _groups(out_census) if opts.layers is None or any(_match(n, opts.layers) for n in g)]
    moe = {layer.name: layer for layer in out_census.moe}
    results: list[ModuleResult] = []
    progress.start(len(groups))
    checked: set[str] = set()
    with ckpt.reader() as ro, src.reader() as rs:
        for g in groups:
            results.append(_check_group(g, ckpt, src, ro, rs, rt, opts))
            checked |= {f"{n}.{s}" for n in g for s in (WEIGHT, WEIGHT_SCALE)}
            progress.advance()
            ro.drop_pages()  # RSS: one group's mapped bytes at a time
            rs.drop_pages()
        for layer in moe.values():
            if opts.layers is None or _match(layer.name, opts.layers):
                results.append(_check_moe(layer, ckpt, src, ro, rs, rt, opts))
                ro.drop_pages()
                rs.drop_pages()
        progress.phase("kept tensors")
        kept = {n: e for n, e in ckpt.tensors.items() if n not in checked}
        pass_problems = compare_bytes(kept, src, ro, rs)
    # completeness: every source tensor is in the output (quantized weights keep their names)
    pass_problems += [{"tensor": n, "problem": "in the source but not in the output"}
                      for n in sorted(set(src.tensors) - set(ckpt.tensors)) if opts.layers is None]
    unchecked = [] if opts.layers else sorted(n for n in ckpt.tensors if n not in checked and n not in kept)
    progress.phase(f"hashing {hashes.count} files")
    file_problems = hashes.result()
    tally = Tally(len(wanted or {}), file_problems, len(kept), pass_problems, len(ckpt.tensors), unchecked)
    return single_rank_report(out, src, "fp8 (quant_method, dynamic activations)", str(rt.device), opts, results, tally,
                              t_all)


def _match(name: str, pattern: str) -> bool:
    from fnmatch import fnmatchcase

    return fnmatchcase(name, pattern)


def _group_scale(ws: list[torch.Tensor]) -> torch.Tensor:
    amax = torch.stack([w.float().abs().max() if w.numel() else torch.zeros(()) for w in ws]).max()
    return torch.ones((), dtype=torch.float32) if float(amax) == 0 else amax / FP8_MAX


def _check_group(names: list[str], ckpt: Checkpoint, src: Checkpoint, ro, rs, rt: Runtime, opts) -> ModuleResult:
    """Bytes and scales of one scale group; dense groups also get a GEMM (MoE experts: _check_moe)."""
    t0 = time.perf_counter()
    problems = Problems()
    src_w = [rs.view(src.tensors[f"{n}.{WEIGHT}"]) for n in names]
    s = _group_scale(src_w)
    inv = torch.reciprocal(s)
    for n, w in zip(names, src_w, strict=True):
        got_w, got_s = ro.view(ckpt.tensors[f"{n}.{WEIGHT}"]), ro.view(ckpt.tensors[f"{n}.{WEIGHT_SCALE}"])
        problems.scalar(f"{n}.weight_scale", got_s, s)
        problems.expect_equal(f"{n}.weight", got_w.view(torch.uint8), expected_fp8(w, inv))
    name = names[0] if len(names) == 1 else names[0].rpartition(".")[0] + "." + "|".join(x.rpartition(".")[2] for x in names)
    res = ModuleResult(name, 0, "fp8_dynamic_linear", "FP8", "", False, {}, math.nan, THRESHOLDS["fp8_dynamic_linear"].kept,
                       False, 0.0, tensors=[f"{n}.{s_}" for n in names for s_ in (WEIGHT, WEIGHT_SCALE)])
    if ".experts." in names[0]:  # numerics for experts run as the whole expert in _check_moe
        res.kind, res.kernel, res.error, res.threshold = "fp8_dynamic_expert_bytes", "bytes and scale only", 0.0, 1.0
    else:
        k = src_w[0].shape[1]
        x = torch.randn(opts.tokens, k, generator=gen(opts.seed, name)).to(rt.device)
        w_src = torch.cat([w.float() for w in src_w]).to(rt.device)
        w_q = torch.cat([ro.view(ckpt.tensors[f"{n}.{WEIGHT}"]) for n in names]).to(rt.device)
        scale = torch.cat([ro.view(ckpt.tensors[f"{n}.{WEIGHT_SCALE}"]).float().reshape(1).expand(
            ckpt.tensors[f"{n}.{WEIGHT}"].shape[0]) for n in names]).to(rt.device)
        out, res.kernel, res.emulated = _fp8_gemm(x, w_q, scale)
        res.error = rel_error(out, x @ w_src.T)
    return finish(res, problems, t0)


def _fp8_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, str, bool]:
    """The engine's dynamic FP8 linear: per-token activation scales, per-tensor (row-expanded) weight scales."""
    xq, xs = fp8_per_token(x)
    try:
        out = scaled_mm(xq, w_q, xs, w_scale.reshape(-1).float().contiguous())
        return out, "torch._scaled_mm (per-token activations)", False
    except (RuntimeError, NotImplementedError):
        return ((xq.float() * xs) @ (w_q.float() * w_scale.reshape(-1, 1)).T,
                "emulated (dequantized FP8, float32 GEMM)", True)


def _check_moe(layer, ckpt: Checkpoint, src: Checkpoint, ro, rs, rt: Runtime, opts) -> ModuleResult:
    """The whole expert computation, stage by stage, on the checked experts of one MoE layer."""
    t0 = time.perf_counter()
    experts = [layer.experts[e] for e in sorted(layer.experts)]
    h = experts[0].gate.out_in[1]
    x = torch.randn(opts.tokens, h, generator=gen(opts.seed, layer.name)).to(rt.device)
    stages = {"gemm1": 0.0, "gemm2": 0.0}
    worst = (-1.0, math.nan, 1.0)
    kernel, emulated = "", False
    sample = sample_experts(len(experts), rt, opts, layer.name)
    for idx in sample:
        ex = experts[idx]

        def q(m: Module):
            return (ro.view(ckpt.tensors[m.tensors[WEIGHT].name]).to(rt.device),
                    ro.view(ckpt.tensors[m.tensors[WEIGHT_SCALE].name]).float().to(rt.device))

        def s(m: Module):
            return rs.view(src.tensors[m.tensors[WEIGHT].name]).float().to(rt.device)

        (g_q, g_s), (u_q, u_s), (d_q, d_s) = q(ex.gate), q(ex.up), q(ex.down)
        i = g_q.shape[0]
        w13 = torch.cat([g_q, u_q])
        sc13 = torch.cat([g_s.reshape(1).expand(i), u_s.reshape(1).expand(i)])
        o1, kernel, emulated = _fp8_gemm(x, w13, sc13)
        ref1 = x @ torch.cat([s(ex.gate), s(ex.up)]).T
        act = F.silu(o1[:, :i]) * o1[:, i:]
        hq, hs = fp8_per_token(act)
        o2, _, _ = _fp8_gemm(act, d_q, d_s.reshape(1).expand(d_q.shape[0]))
        ref2 = (hq.float() * hs) @ s(ex.down).T
        for stage, out, ref in (("gemm1", o1, ref1), ("gemm2", o2, ref2)):
            err = rel_error(out, ref)
            thr = THRESHOLDS["fp8_dynamic_moe"].gemm2 if stage == "gemm2" else THRESHOLDS["fp8_dynamic_moe"].kept
            stages[stage] = math.nan if math.isnan(err) or math.isnan(stages[stage]) else max(stages[stage], err)
            ratio = math.inf if math.isnan(err) else err / thr
            if ratio > worst[0]:
                worst = (ratio, err, thr)
    stages["experts_numeric"] = len(sample)
    res = ModuleResult(layer.name, 0, "fp8_dynamic_moe", "FP8", kernel, emulated,
                       {"experts": len(experts)}, worst[1], worst[2], False, 0.0, stages=stages)
    return finish(res, Problems(), t0)

