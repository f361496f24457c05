"""``mocli convert``: validate, plan, then stream one work unit at a time into kernel-ready shards.

The streaming, resume, lock, atomic publish and torchrun machinery is ``mocli.engine``; this module
decides what to write (``mocli.plan``) and the metadata around it (index, manifest, provenance).
Never prints: progress goes through a callback, the result is a summary dict.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from mocli import __version__
from mocli.checkpoint import INDEX_NAME, Checkpoint
from mocli.errors import FindingsError, InputError
from mocli.findings import Findings
from mocli.io.digests import SourceDigests
from mocli.io.shard_writer import DEFAULT_MAX_SHARD_BYTES, ShardLayout, TensorSpec, layout_shards
from mocli.parallel import Heads, ParallelLayout
from mocli.quant_config import CONFIG_JSON, HF_QUANT_CONFIG
from mocli.targets import Target


class ConversionRefused(FindingsError):
    """validate found errors that make the checkpoint unconvertible for the target (exit 1)."""

    def __init__(self, findings: Findings, verb: str = "convert") -> None:
        errs = findings.errors
        first = errs[0]
        super().__init__(
            f"refusing to {verb}: {len(errs)} validation error(s); first: {first.code} {first.location}: "
            f"{first.message}", hint=first.hint or "run mocli validate for the full report")
        self.findings = findings


def require_modelopt(ckpt: Checkpoint, verb: str) -> None:
    """convert and repair read ModelOpt exports; vLLM's fp8 format (mocli quantize's output) is served as is."""
    if ckpt.quant is not None and ckpt.quant.method != "modelopt":
        raise InputError(f"{ckpt.path}: quant_method {ckpt.quant.method} (dynamic activations) is not a ModelOpt "
                         f"export; {verb} reads ModelOpt checkpoints",
                         hint="serve it as it is (the config says fp8), or check it with mocli verify")


def resolve_device(device: str):
    """--device as a torch device; under torchrun each process takes its own GPU (LOCAL_RANK)."""
    import os

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available", hint="use --device cpu or auto")
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def fingerprint(command: str, ckpt: Checkpoint, layouts: dict[str, ShardLayout], extra: dict[str, Any]) -> str:
    """Identifies a run's output exactly: a journal only resumes a run with the same fingerprint."""
    ident = {"command": command, "mocli": __version__, **extra,
             "source": [(h.path.name, h.size, h.header_sha256) for h in ckpt.files],
             "shards": {g: lay.to_dict() for g, lay in layouts.items()}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def group_layouts(tensors: list, max_shard_bytes: int) -> dict[str, ShardLayout]:
    """Each output group's shards, tensors in plan order."""
    specs: dict[str, list[TensorSpec]] = {}
    for t in tensors:
        specs.setdefault(t.group, []).append(TensorSpec(t.name, t.dtype, t.shape, t.nbytes))
    return {g: layout_shards(s, max_shard_bytes) for g, s in specs.items()}


def provenance_block(ckpt: Checkpoint, digests: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"version": __version__, **extra,
            "source": ({"repo_id": ckpt.source.repo_id, "revision": ckpt.source.revision} if ckpt.source.repo_id
                       else {"path": str(ckpt.path)}),
            "source_shards": digests}


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def copy_configs(ckpt: Checkpoint, dest: Path, provenance: dict[str, Any], key: str = "mocli",
                 edit=None) -> None:
    """Both config files with the provenance block (and ``edit`` applied), other small files as they are."""
    from mocli.io.jsonfile import read_json

    src = ckpt.path
    if (src / HF_QUANT_CONFIG).exists():
        hq = read_json(src / HF_QUANT_CONFIG)
        if isinstance(hq, dict):
            if edit is not None:
                edit(HF_QUANT_CONFIG, hq)
            hq[key] = provenance
        write_json(dest / HF_QUANT_CONFIG, hq)
    if (src / CONFIG_JSON).exists():
        cfg = read_json(src / CONFIG_JSON)
        if isinstance(cfg, dict):
            if edit is not None:
                edit(CONFIG_JSON, cfg)
            if isinstance(cfg.get("quantization_config"), dict):
                cfg["quantization_config"][key] = provenance
        write_json(dest / CONFIG_JSON, cfg)
    # Tokenizer, generation config and the like travel unchanged.
    skip = {INDEX_NAME, HF_QUANT_CONFIG, CONFIG_JSON}
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in skip and not p.name.startswith(".mocli"):
            shutil.copyfile(p, dest / p.name)


def convert(ckpt: Checkpoint, out: Path, target: Target, device: str = "auto", overwrite: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress=None, tp: int = 1, ep: int = 1,
            digests: SourceDigests | None = None, dist=None) -> dict[str, Any]:
    """Convert ``ckpt`` for ``target`` (at ``tp``/``ep`` ranks) into ``out``; returns the summary."""
    digests = digests or SourceDigests([h.path for h in ckpt.files])
    from mocli import engine
    from mocli.census import build_census
    from mocli.plan import LAYOUT_VERSION, MANIFEST_NAME, build_plan, convert_manifest
    from mocli.scales import read_scales
    from mocli.validate import validate

    t0 = time.perf_counter()
    progress = progress or engine.Progress()
    dist = dist or engine.Dist()
    dev = resolve_device(device)
    out = Path(out)
    if tp < 1 or ep < 1:
        raise InputError(f"--tp {tp} --ep {ep}: sizes must be at least 1", hint="e.g. --tp 8, or --tp 2 --ep 2")
    parallel = ParallelLayout(tp, ep)
    require_modelopt(ckpt, "convert")
    engine.check_output(out, overwrite, ckpt.path)
    progress.phase("planning")
    census = build_census(ckpt.tensors)
    scales = read_scales(ckpt, census)
    report = validate(ckpt, target, census, scales, parallel=parallel)
    if report.findings.errors:
        raise ConversionRefused(report.findings)

    import torch

    plan = build_plan(census, {k: torch.from_numpy(v.copy()) for k, v in scales.items()}, target, parallel,
                      Heads.from_config(ckpt.config))
    layouts = group_layouts(list(plan.tensors.values()), max_shard_bytes)
    fp = fingerprint("convert", ckpt, layouts, {"layout_version": LAYOUT_VERSION, "target": str(target),
                                                "parallel": parallel.to_dict(),
                                                "tensors": {f"{g}/{n}": t.to_dict() for (g, n), t in plan.tensors.items()}})
    manifest = convert_manifest(plan, target, parallel)

    def finish(partial: Path, files: dict[str, str]) -> None:
        provenance = provenance_block(ckpt, digests.result(), target=str(target), layout_version=LAYOUT_VERSION,
                                      layout=MANIFEST_NAME, parallel=parallel.to_dict())
        for g, lay in layouts.items():
            d = partial / g if g else partial
            total = sum(t.nbytes for t in plan.tensors.values() if t.group == g)
            write_json(d / INDEX_NAME, {"metadata": {"total_size": total, "mocli_layout": MANIFEST_NAME},
                                        "weight_map": lay.weight_map()})
        sizes = {(f"{g}/{f.name}" if g else f.name): f.size for g, lay in layouts.items() for f in lay.files}
        write_json(partial / MANIFEST_NAME, {**manifest, "files": {name: {"size": sizes[name], "sha256": files[name]}
                                                                    for name in sorted(files)},
                                             "provenance": provenance})
        copy_configs(ckpt, partial, provenance)

    job = engine.Job("convert", out, ckpt.path, plan, layouts, fp, finish, overwrite, dev, progress, dist)
    result = engine.run(job)
    warnings = [f.to_dict() for f in report.findings.warnings]
    return {
        "output": str(out), "target": str(target), "device": str(dev), "tensors": len(plan.tensors),
        "parallel": parallel.to_dict(), "bytes": result.bytes, "shards": len(result.files),
        "units": result.units, "resumed_units": result.resumed_units, "modules": len(plan.modules),
        "seconds": round(time.perf_counter() - t0, 3), "repairs": plan.repairs, "warnings": warnings,
        "discarded_partial_bytes": result.discarded_partial,
    }
