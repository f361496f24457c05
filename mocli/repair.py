"""``mocli repair``: fix what validate finds, in the ModelOpt format engines already load (SEMANTICS §11).

Plans from validate's findings (with the deep byte scan, so NaN bytes are refused before anything
is written): every repairable finding gets a repair, anything else refuses the whole run. The
output keeps the source's shard names and tensor order; every tensor not repaired is a verbatim
copy (never a hard link); both config files are rewritten consistently with a provenance block
listing each repair. Streaming, resume, lock and atomic publish are ``mocli.stream``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mocli.census import Census, Module
from mocli.checkpoint import Checkpoint
from mocli.errors import InputError, Refused
from mocli.exclusions import reconcile_exclusions
from mocli.findings import Finding, Findings
from mocli.formats import CONFIG_JSON, HF_QUANT_CONFIG, provenance_block
from mocli.io.digests import SourceDigests
from mocli.io.safetensors_file import TensorEntry
from mocli.quant_config import Algo
from mocli.schemes import Merge
from mocli.tables import INPUT_SCALE, SCALE_SUFFIXES, WEIGHT_SCALE
from mocli.validate.mxfp4 import MODELOPT_HINT, MODELOPT_REFUSAL, modelopt_refuses

# Findings a repair fixes (SEMANTICS §11.1-4). Everything else that is an error refuses the run:
# NaN/Inf or non-positive weight scales, NaN weight bytes, missing weights, wrong dtypes or shapes,
# missing experts - mocli never invents a weight or a weight scale.
REPAIRABLE = {"SCL005", "SCL003", "EXC001", "EXC002", "EXC003", "EXC004", "EXC005", "EXC006",
              "CFG001", "CFG002", "CFG003", "CFG004", "CFG006", "TNS004", "TNS005"}


@dataclass
class Repair:
    code: str  # the finding it fixes
    location: str
    action: str
    old: Any = None
    new: Any = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TensorEdit:
    """A repaired output tensor: computed by ``make`` (a function of the unit context), or ``value``."""

    spec: tuple[str, tuple[int, ...]]  # dtype, shape
    make: Callable | None = None
    inputs: list[TensorEntry] = field(default_factory=list)


@dataclass
class RepairPlan:
    repairs: list[Repair] = field(default_factory=list)
    refused: list[Finding] = field(default_factory=list)
    edits: dict[str, TensorEdit] = field(default_factory=dict)  # replaced or added tensors
    added_after: dict[str, str] = field(default_factory=dict)  # added tensor -> the tensor it follows
    dropped: set[str] = field(default_factory=set)
    config_fields: dict[str, Any] = field(default_factory=dict)  # canonical quantization settings

    def to_dict(self) -> dict[str, Any]:
        return {"repairs": [r.to_dict() for r in self.repairs], "refused": [f.to_dict() for f in self.refused],
                "nothing_to_do": not self.repairs and not self.refused}


# --- planning -----------------------------------------------------------------------------------------

def plan_repair(ckpt: Checkpoint, progress=None) -> RepairPlan:
    from mocli.scales import read_scales
    from mocli.validate import validate

    if ckpt.quant is None:
        raise Refused(_only(ckpt.config_findings) or _no_config(ckpt), verb="repair")
    ckpt.require_quant_method("repair")
    census = ckpt.census()
    scales = read_scales(census)
    report = validate(ckpt, None, census, scales, deep=True, progress=progress)
    plan = RepairPlan()
    codes = {f.code for f in report.findings}
    layers = {layer.name for layer in census.moe}
    # SCL003 is repairable per expert; at a whole layer (no expert has a scale) there is nothing to
    # take the max of (SEMANTICS §11.2)
    plan.refused = [f for f in report.findings.errors if f.code not in REPAIRABLE
                    or (f.code == "SCL003" and f.location in layers)] + _mixed_storage(census)
    if plan.refused:
        return plan
    _unify_scale_2(plan, census, scales)
    _fill_input_scales(plan, census, scales)
    _drop_stray_scales(plan, census)
    _reconcile_config(plan, ckpt, census, codes)
    return plan


def _mixed_storage(census: Census) -> list[Finding]:
    """Shards the engine loads as one, stored partly quantized: fixing that means new weights."""
    out = []
    for g in census.fused:
        stored = {m.scheme is None for m in g.shards}
        if len(stored) > 1:
            out.append(Finding("EXC002", g.name, "shards are stored partly quantized and partly not",
                               "no repair re-quantizes weights; re-export the checkpoint"))
    for layer in census.moe:
        if None in layer.schemes and len(layer.schemes) > 1:
            out.append(Finding("TNS006", layer.name, "experts are stored partly quantized and partly not",
                               "no repair re-quantizes weights; re-export the checkpoint"))
    return out


def _only(findings: Findings) -> Findings:
    return Findings([f for f in findings if f.severity == "error"])


def _no_config(ckpt: Checkpoint) -> Findings:
    f = Findings()
    f.add("CFG005", str(ckpt.path), "no ModelOpt quantization config", hint="is this a ModelOpt export?")
    return f


def _scalar(scales, m: Module, suffix: str) -> float | None:
    t = m.tensors.get(suffix)
    v = scales.get(t.name) if t is not None else None
    return None if v is None or v.size != 1 else float(v.reshape(-1)[0])


def _unify_scale_2(plan: RepairPlan, census: Census, scales) -> None:
    """§11.1: NVFP4 shards the engine merges get S2 = max; the others' block scales rescaled (§6)."""
    groups = [list(g.shards) for g in census.fused]
    for layer in census.moe:
        groups += [[layer.experts[e].gate, layer.experts[e].up] for e in sorted(layer.experts)]
    for mods in groups:
        schemes = {m.scheme for m in mods if m is not None}
        scheme = schemes.pop() if len(schemes) == 1 and None not in schemes and None not in mods else None
        if scheme is None or scheme.merge is not Merge.RESCALE:
            continue
        values = [_scalar(scales, m, scheme.merged_scale) for m in mods]
        if None in values or len(set(values)) == 1:
            continue
        big = max(values)
        for m, v in zip(mods, values, strict=True):
            if v == big:
                continue
            bs = m.tensors[WEIGHT_SCALE]
            plan.edits[bs.name] = TensorEdit((bs.dtype, bs.shape), _rescaler(bs, v, big), [bs])
            s2 = m.tensors[scheme.merged_scale]
            plan.edits[s2.name] = TensorEdit(("F32", s2.shape), _constant(big, s2.shape))
            plan.repairs.append(Repair("SCL005", m.name, "weight_scale_2 unified to the group's max, block scales "
                                       "rescaled (SEMANTICS §6)", v, big))


def _fill_input_scales(plan: RepairPlan, census: Census, scales) -> None:
    """§11.2: an expert without input_scale gets the max of the layer's other experts' (w1/w3 and
    w2 separately), the value the engine's max reduction uses for the layer anyway."""
    for layer in census.moe:
        experts = [layer.experts[e] for e in sorted(layer.experts)]
        gate_up = [v for ex in experts for m in (ex.gate, ex.up) if m is not None
                   if (v := _scalar(scales, m, INPUT_SCALE)) is not None]
        down = [v for ex in experts if ex.down is not None if (v := _scalar(scales, ex.down, INPUT_SCALE)) is not None]
        for ex in experts:
            for m, pool in ((ex.gate, gate_up), (ex.up, gate_up), (ex.down, down)):
                if m is None or m.scheme is None or not m.scheme.static_input or INPUT_SCALE in m.tensors:
                    continue  # weight-only and dynamic-activation schemes have no input scale to fill
                name = f"{m.name}.{INPUT_SCALE}"
                value = max(pool)  # non-empty: plan_repair refuses a layer where no expert has one
                plan.edits[name] = TensorEdit(("F32", ()), _constant(value, ()))
                plan.added_after[name] = max((e.name for e in m.tensors.values()), key=lambda n: m.tensors[n.rpartition(".")[2]].start)
                plan.repairs.append(Repair("SCL003", m.name, "input_scale added: the max over the layer's other "
                                           "experts", None, value))


def _drop_stray_scales(plan: RepairPlan, census: Census) -> None:
    for m in census.modules.values():
        if m.scheme is None:
            for s in sorted(set(m.tensors) & SCALE_SUFFIXES):
                plan.dropped.add(m.tensors[s].name)
                plan.repairs.append(Repair("TNS004", m.tensors[s].name, "dropped: a scale on an unquantized module"))


def _stored_algo(census: Census) -> tuple[Algo | None, dict[str, dict], int | None]:
    """The algorithm the stored tensors say, MIXED_PRECISION's per-layer table if they differ, and the
    group size their schemes share (None: none has one, or they differ)."""
    quantized = {m.name: m.scheme for m in census.modules.values() if m.scheme is not None and m.is_linear}
    schemes = set(quantized.values())
    sizes = {s.group_size for s in schemes if s.group_size}
    group = sizes.pop() if len(sizes) == 1 else None
    if len(schemes) == 1:
        return schemes.pop().algo, {}, group
    layers = {n: {"quant_algo": str(s), **({"group_size": s.group_size} if s.group_size else {})}
              for n, s in sorted(quantized.items())}
    return (Algo.MIXED_PRECISION if schemes else None), layers, group


def _reconcile_config(plan: RepairPlan, ckpt: Checkpoint, census: Census, codes: set[str]) -> None:
    """§11.3-4: exclusions and the quantization fields from what is stored; both files the same."""
    quant = ckpt.quant
    rewrite = reconcile_exclusions(quant.exclude_modules, census)
    if rewrite.impossible:
        plan.refused.append(Finding("EXC002", rewrite.impossible[0], "no exclusion list describes how this is "
                                    "stored (the engine's substring rule reaches a quantized module)",
                                    "re-export with consistent exclusions"))
        return
    for code, where, what in rewrite.changes:
        plan.repairs.append(Repair(code, where, what))
    algo, layers, group = _stored_algo(census)
    if algo is not quant.algo and modelopt_refuses(quant.method, (algo, *(v.get("quant_algo") for v in layers.values()))):
        # relabelling after the tensors would name what vLLM refuses (and drop what the old name meant, e.g.
        # W4A8_MXFP4_FP8's FP8 activations): an output no engine loads is no repair
        plan.refused.append(Finding("VLL002", "quant_algo", f"the tensors store MXFP4, and {MODELOPT_REFUSAL}",
                                    MODELOPT_HINT))
        return
    fields: dict[str, Any] = {"exclude_modules": rewrite.entries}
    if algo is not None and algo is not quant.algo:
        plan.repairs.append(Repair("TNS005" if "TNS005" in codes else "CFG003", "quant_algo",
                                   "set to what the tensors store", str(quant.algo) if quant.algo else None, str(algo)))
    if algo is not None:
        fields["quant_algo"] = str(algo)
    if algo is Algo.MIXED_PRECISION:
        old = {k: {"quant_algo": str(v.algo), **({"group_size": v.group_size} if v.group_size else {})}
               for k, v in quant.quantized_layers.items()}
        if old != layers:
            plan.repairs.append(Repair("CFG006" if "CFG006" in codes else "TNS005", "quantized_layers",
                                       "rewritten from the stored tensors", len(old), len(layers)))
        fields["quantized_layers"] = layers
    kv = "FP8" if census.kv_scales else quant.kv_cache_algo
    if kv != quant.kv_cache_algo:
        plan.repairs.append(Repair("CFG004", "kv_cache_quant_algo", "set to what the tensors store", quant.kv_cache_algo, kv))
    fields["kv_cache_quant_algo"] = kv
    if group is not None:
        if quant.group_size != group:
            plan.repairs.append(Repair("CFG002" if quant.group_size else "CFG001", "group_size",
                                       f"set to the stored {group}-element blocks", quant.group_size, group))
        fields["group_size"] = group
    hf, cj = ckpt.hf_quant_config, ckpt.config_quant
    if hf is not None and cj is not None and "CFG004" in codes:
        plan.repairs.append(Repair("CFG004", f"{HF_QUANT_CONFIG} vs {CONFIG_JSON}", "both rewritten from the "
                                   "reconciled settings"))
    plan.config_fields = fields


def _rescaler(entry: TensorEntry, s2: float, big: float) -> Callable:
    def make(ctx):
        import numpy as np

        from mocli.ops import fp8
        from mocli.stream.units import BadData

        raw = ctx.array(entry)
        if fp8.has_nan_fp8(raw):
            raise BadData(entry.name, "FP8 block scales encode NaN")
        return np.ascontiguousarray(fp8.rescale_block_scales(raw, np.float32(s2), np.float32(big)))
    return make


def _constant(value: float, shape: tuple[int, ...]) -> Callable:
    def make(ctx):
        import numpy as np

        return np.full(shape, value, dtype=np.float32)
    return make


# --- the run ----------------------------------------------------------------------------------------------

def repair(ckpt: Checkpoint, out: Path | None, dry_run: bool = False, overwrite: bool = False, progress=None,
           digests: SourceDigests | None = None, dist=None) -> dict[str, Any]:
    """Plan (and unless ``dry_run``, write) the repaired checkpoint; returns the summary."""
    from mocli import stream

    t0 = time.perf_counter()
    progress = progress or stream.Progress()
    if not dry_run:
        if out is None:
            raise InputError("repair needs -o OUT (or --dry-run)", hint="e.g. mocli repair MODEL -o MODEL-fixed")
        stream.check_output(Path(out), overwrite, ckpt.path)
    progress.phase("checking every byte")
    plan = plan_repair(ckpt, progress)
    summary = {"source": ckpt.source.describe(), "output": None if dry_run else str(out), **plan.to_dict()}
    if plan.refused:
        findings = Findings(plan.refused)
        err = Refused(findings, verb="repair")
        err.message = (f"refusing to repair: {len(plan.refused)} finding(s) no repair can fix; first: "
                       f"{plan.refused[0].code} {plan.refused[0].location}: {plan.refused[0].message}")
        err.hint = "nothing was written; " + (plan.refused[0].hint or "re-export the checkpoint")
        err.summary = summary
        raise err
    if dry_run:
        summary["seconds"] = round(time.perf_counter() - t0, 3)
        return summary
    digests = digests or SourceDigests([h.path for h in ckpt.files])
    job_plan, layouts = _stream_plan(ckpt, plan)
    repairs = [r.to_dict() for r in plan.repairs]
    fp = stream.fingerprint("repair", ckpt.files, layouts, {"repairs": repairs, "fields": plan.config_fields})

    def finish(partial: Path, files: dict[str, str]) -> None:
        from mocli.formats.modelopt import write_modelopt

        provenance = provenance_block(ckpt.source, digests.result(), repairs=repairs,
                                      output_shards=dict(sorted(files.items())))
        write_modelopt(partial, ckpt.path, layouts[""], ckpt.sharded, plan.config_fields, provenance)

    job = stream.Job("repair", Path(out), ckpt.path, job_plan, layouts, fp, finish, overwrite=overwrite,
                     progress=progress, dist=dist or stream.Dist(), source_digests=digests)
    result = stream.run(job)
    summary.update(bytes=result.bytes, tensors=len(job_plan.tensors), resumed_units=result.resumed_units,
                   units=result.units, seconds=round(time.perf_counter() - t0, 3))
    return summary


def _stream_plan(ckpt: Checkpoint, rp: RepairPlan):
    """Output tensors file by file in the source's order (added ones after their module), units in
    file order: runs of verbatim copies batched, each repaired tensor computed in a unit of its own."""
    from mocli.io.shard_writer import ShardLayout, TensorSpec
    from mocli.stream.units import OutTensor, Piece, Plan, Unit

    plan = Plan()
    out = []
    after: dict[str, list[str]] = {}
    for added, anchor in rp.added_after.items():
        after.setdefault(anchor, []).append(added)
    for header in ckpt.files:
        names = []
        for e in sorted(header.tensors.values(), key=lambda e: e.start):
            if e.name not in rp.dropped:
                names.append(e.name)
            names += sorted(after.get(e.name, ()))
        copies: list[TensorEntry] = []
        for n in names:
            if n not in rp.edits:
                copies.append(ckpt.tensors[n])
                continue
            plan.copy_units(copies, role="copy")
            copies = []
            edit = rp.edits[n]
            plan.add(OutTensor(n, *edit.spec, "repaired", [n], []))
            plan.units.append(Unit(f"repair:{n}", edit.inputs, [("", n)],  # numpy: repair never loads torch
                                   lambda ctx, n=n, make=edit.make: [Piece(("", n), 0, make(ctx))], torch_free=True))
        plan.copy_units(copies, role="copy")
        # each shard keeps its source's own metadata (the layout adds format: pt where it is missing)
        specs = [TensorSpec(n, plan.tensors["", n].dtype, plan.tensors["", n].shape, plan.tensors["", n].nbytes)
                 for n in names]
        meta = {k: v for k, v in header.metadata.items() if isinstance(k, str) and isinstance(v, str)}
        out += ShardLayout.from_files([(header.path.name, specs)], meta).files
    return plan, {"": ShardLayout(out)}
