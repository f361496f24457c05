"""``mocli quantize``: the engines' online FP8 quantization of an unquantized checkpoint, done once
offline (SEMANTICS §12).

Quantized as one tensor, with one scale, exactly as the engine groups them: a fused group
(q|k|v, gate|up), one expert's w1 and w3, one expert's w2, any other linear alone. Scale
``s = amax(|float32(w)|) / 448`` (1 where amax is 0), values ``fp8(clamp(float32(w) * (1/s), ±448))``.
Embeddings, lm_head, norms, routers, biases, 1-D tensors, vision towers and user excludes stay as
they are. The output is vLLM/SGLang's serialized FP8 format (``quant_method: fp8``, dynamic
activations). Streaming, resume, lock and publish are ``mocli.stream``'s.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path
from typing import Any

from mocli.census import Census, Kind, Module
from mocli.checkpoint import Checkpoint
from mocli.errors import InputError
from mocli.formats import provenance_block
from mocli.io.digests import SourceDigests
from mocli.io.shard_writer import DEFAULT_MAX_SHARD_BYTES, group_layouts
from mocli.ops.fp8 import FP8_MAX
from mocli.tables import WEIGHT

QUANTIZABLE_DTYPES = {"BF16", "F16", "F32"}
# Routers stay in the source dtype (SEMANTICS §12).
ROUTERS = ("mlp.gate", "block_sparse_moe.gate")
# Where the engine's online path differs from §12, per architecture and version (measured, not assumed):
# vLLM 0.32.0 builds Qwen3-MoE's router as GateLinear(quant_config=quant_config) (models/qwen3_moe.py),
# so `--quantization fp8_per_tensor` (`fp8` is its deprecated alias there) quantizes mlp.gate online;
# Mixtral's gate gets no quant config (models/mixtral.py). This output keeps every router in BF16 and
# lists it in ignored_layers, so an engine serving it routes in BF16.
ONLINE_QUANTIZED_ROUTERS: dict[str, str] = {
    "Qwen3MoeForCausalLM": "vLLM 0.32.0 quantizes it online (GateLinear with the quant config)",
}
# Vision towers and projectors of VLMs (vLLM quantizes only the language model's linears).
VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|multi_modal_projector|mm_projector)(\.|$)")


@dataclass
class Group:
    """Modules quantized as one tensor (one scale)."""

    name: str
    modules: list[Module]


@dataclass
class QuantizePlan:
    groups: list[Group] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # linears left unquantized: ignored_layers
    notes: list[str] = field(default_factory=list)


def plan_groups(census: Census, exclude: list[str]) -> QuantizePlan:
    """Which modules become FP8 and in which groups; everything else is kept."""
    plan = QuantizePlan()

    def excluded(m: Module) -> str | None:
        if m.weight.dtype not in QUANTIZABLE_DTYPES:
            return f"weight dtype {m.weight.dtype}"
        if any(m.name == r or m.name.endswith("." + r) for r in ROUTERS):
            return "router"
        if VISION.search(m.name):
            return "vision tower"
        if any(fnmatchcase(m.name, p) or m.name == p or fnmatchcase(m.engine_name, p) for p in exclude):
            return "--exclude"
        return None

    linears = [m for m in census.modules.values() if m.kind in (Kind.LINEAR, Kind.FUSED_SHARD, Kind.EXPERT)]
    if not linears:
        raise InputError("no linear layers to quantize", hint="quantize takes an unquantized transformer checkpoint")
    for g in census.fused:
        why = [w for m in g.shards if (w := excluded(m))]
        if why:
            plan.kept += [m.name for m in g.shards]
            if len(why) < len(g.shards):
                plan.notes.append(f"{g.name}: kept whole, part of it was excluded ({why[0]}); engines load a "
                                  "fused group in one dtype")
        else:
            plan.groups.append(Group(g.name, list(g.shards)))
    for layer in census.moe:
        mods = [m for ex in layer.experts.values() for _, m in ex.projections() if m is not None]
        why = [w for m in mods if (w := excluded(m))]
        if why:
            plan.kept.append(layer.name)
            if len(why) < len(mods):
                plan.notes.append(f"{layer.name}: kept whole, part of it was excluded ({why[0]}); the fused-MoE "
                                  "kernel takes all experts in one dtype")
            continue
        for e in sorted(layer.experts):
            ex = layer.experts[e]
            # the engine quantizes the stacked w13[e] = [w1; w3] as one tensor (SEMANTICS §12)
            plan.groups.append(Group(f"{layer.name}.{e}.w13", [ex.gate, ex.up]))
            plan.groups.append(Group(f"{layer.name}.{e}.w2", [ex.down]))
    for m in linears:
        if m.kind is Kind.LINEAR:
            if excluded(m):
                plan.kept.append(m.name)
            else:
                plan.groups.append(Group(m.name, [m]))
    return plan


# --- the quantization itself (pure) ---------------------------------------------------------------------

@lru_cache(maxsize=64)
def _table(dtype: str, inv_bits: int):
    """fp8 bytes of every 16-bit input value: fp8(clamp(float32(w) * inv, ±448)), the formula itself."""
    import torch

    inv = torch.tensor(inv_bits, dtype=torch.int32).view(torch.float32)
    vals = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16 if dtype == "BF16" else torch.float16)
    return (vals.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def group_scale(amax):
    """s = amax / 448 in float32; amax = 0 gives 1 (mocli policy: the engine would divide by zero)."""
    import torch

    a = amax.to(torch.float32).reshape(())
    return torch.ones((), dtype=torch.float32) if float(a) == 0 else a / FP8_MAX


def amax_of(t):
    """max |w| of a tensor, as float32 (max and min: no temporary |w| copy)."""
    import torch

    lo, hi = torch.aminmax(t.reshape(-1)) if t.numel() else (torch.zeros(()), torch.zeros(()))
    return torch.maximum(hi.float().abs(), lo.float().abs())


def quantize_values(w, inv, out=None, scratch=None):
    """fp8(clamp(float32(w) * inv, ±448)). CPU 16-bit inputs: an exact table lookup, 64K entries
    built with the same formula; otherwise (CUDA, float32) the formula itself. Same bytes either way."""
    import torch

    if w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16):
        table = _table("BF16" if w.dtype == torch.bfloat16 else "F16", int(inv.reshape(()).view(torch.int32)))
        src = w.contiguous().view(torch.int16).reshape(-1)
        res = out if out is not None else torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        dst = res.view(torch.uint8).reshape(-1)
        idx = scratch if scratch is not None else torch.empty(min(src.numel(), 1 << 18), dtype=torch.int32)
        step = idx.numel()
        for a in range(0, src.numel(), step):
            b = min(a + step, src.numel())
            ix = idx[: b - a]
            ix.copy_(src[a:b])
            ix.bitwise_and_(0xFFFF)
            torch.index_select(table, 0, ix, out=dst[a:b])
        return res
    x = w.to(torch.float32) * inv.to(w.device, torch.float32)
    return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# --- the run ----------------------------------------------------------------------------------------------

def quantize(ckpt: Checkpoint, out: Path, scheme: str = "fp8", exclude: list[str] | None = None,
             device: str = "auto", overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
             progress=None, digests: SourceDigests | None = None, dist=None) -> dict[str, Any]:
    """Quantize ``ckpt`` into ``out``; returns the summary."""

    from mocli import stream
    from mocli.devices import resolve_device
    from mocli.formats.fp8 import write_fp8

    t0 = time.perf_counter()
    if scheme != "fp8":
        raise InputError(f"--scheme {scheme}: not supported", hint="fp8 (per-tensor weights, dynamic activations)")
    if ckpt.quant is not None:
        raise InputError(f"{ckpt.path}: already quantized ({ckpt.quant.method} {ckpt.quant.algo})",
                         hint="quantize takes an unquantized (BF16/FP16) checkpoint")
    progress = progress or stream.Progress()
    dist = dist or stream.Dist()
    dev = resolve_device(device)
    out = Path(out)
    stream.check_output(out, overwrite, ckpt.path)
    progress.phase("planning")
    census = ckpt.census()
    qp = plan_groups(census, exclude or [])
    digests = digests or SourceDigests([h.path for h in ckpt.files])

    plan = _plan(ckpt, qp)
    layouts = group_layouts(list(plan.tensors.values()), max_shard_bytes)
    ignored = sorted(set(qp.kept) | {m.name for m in census.modules.values() if m.kind is Kind.EMBEDDING},
                     key=_natural)
    fp = stream.fingerprint("quantize", ckpt.files, layouts, {
        "scheme": scheme, "ignored": ignored, "tensors": {n: t.to_dict() for (_, n), t in plan.tensors.items()}})

    def finish(partial: Path, files: dict[str, str]) -> None:
        prov = provenance_block(ckpt.source, digests.result(), command="quantize", scheme=scheme,
                                output_shards=dict(sorted(files.items())))
        write_fp8(partial, ckpt.path, layouts[""], ignored, prov)

    job = stream.Job("quantize", out, ckpt.path, plan, layouts, fp, finish, overwrite=overwrite, device=str(dev),
                     progress=progress, dist=dist, source_digests=digests,
                     args={"--scheme": scheme, "--exclude": sorted(exclude or []), "--max-shard-size": max_shard_bytes})
    result = stream.run(job)
    online = ONLINE_QUANTIZED_ROUTERS.get(ckpt.architecture or "")
    deviations = [{"layer": n, "here": "kept in the source dtype (SEMANTICS §12)", "engine_online": online}
                  for n in ignored if online and any(n.endswith("." + r) for r in ROUTERS)]
    return {"output": str(out), "scheme": scheme, **result.device_fields(), "quantized_modules": sum(len(g.modules) for g in qp.groups),
            "deviations_from_online": deviations,
            "groups": len(qp.groups), "ignored_layers": ignored, "notes": qp.notes, "tensors": len(plan.tensors),
            "bytes": result.bytes, "shards": len(result.files), "units": result.units,
            "resumed_units": result.resumed_units, "seconds": round(time.perf_counter() - t0, 3)}


def _plan(ckpt: Checkpoint, qp: QuantizePlan):
    """Output order = unit order (files are appended front to back): groups and kept tensors in the
    model's natural order, runs of kept tensors batched into verbatim-copy units."""
    from mocli.stream.units import OutTensor, Plan, Unit

    plan = Plan()
    copies: list = []
    for item in _natural_order(ckpt, qp):
        if not isinstance(item, Group):
            copies.append(item)
            continue
        plan.copy_units(copies)
        copies = []
        keys = []
        for m in item.modules:
            w = m.tensors[WEIGHT]
            keys.append(("", plan.add(OutTensor(w.name, "F8_E4M3", w.shape, "weight", [w.name],
                                                ["quantize_fp8_per_tensor"]))))
            keys.append(("", plan.add(OutTensor(f"{m.name}.weight_scale", "F32", (), "weight_scale", [w.name],
                                                ["amax / 448 over " + item.name]))))
        plan.units.append(Unit(f"quant:{item.name}", [m.tensors[WEIGHT] for m in item.modules], keys, _group_run(item),
                               compute=True))
    plan.copy_units(copies)
    return plan


def _natural_order(ckpt: Checkpoint, qp: QuantizePlan) -> list:
    """Groups (once, at their first weight) and every other tensor, in the model's natural order."""
    members = {m.name: g for g in qp.groups for m in g.modules}
    quantized = {m.tensors[WEIGHT].name for g in qp.groups for m in g.modules}
    items, seen = [], set()
    for name in sorted(ckpt.tensors, key=_natural):
        g = members.get(name.rpartition(".")[0])
        if g is None or name not in quantized:
            items.append((_natural(name), ckpt.tensors[name]))
        elif g.name not in seen:
            seen.add(g.name)
            items.append((_natural(g.modules[0].name), g))
    return [item for _, item in items]


def _group_run(g: Group):
    def run(ctx):
        import torch

        from mocli.stream.units import BadData, Piece

        loaded = [ctx.load(m.tensors[WEIGHT]) for m in g.modules]
        amax = torch.stack([amax_of(w) for w in loaded]).max()
        if not bool(torch.isfinite(amax)):
            bad = next(m for m, w in zip(g.modules, loaded, strict=True) if not bool(torch.isfinite(amax_of(w))))
            raise BadData(bad.tensors[WEIGHT].name, "weights hold NaN or Inf")
        s = group_scale(amax.cpu())
        inv = torch.reciprocal(s)  # the float32 reciprocal first, as vLLM's scaled_fp8_quant
        pieces = []
        for m, w in zip(g.modules, loaded, strict=True):
            q = quantize_values(w, inv, out=ctx.buffer(tuple(w.shape), torch.float8_e4m3fn) if ctx.device.type == "cpu"
                                else None)
            pieces += [Piece(("", m.tensors[WEIGHT].name), 0, q), Piece(("", f"{m.name}.weight_scale"), 0, s.clone())]
        return pieces
    return run


def _natural(name: str) -> list:
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", name)]

