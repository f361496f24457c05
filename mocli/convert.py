"""``mocli convert``: validate, plan, then stream one work unit at a time into kernel-ready shards.

Convert decides what to write (``mocli.plan``); the stream runner (``mocli.stream``) streams, resumes,
locks and publishes; ``mocli.formats.layout`` writes the index and manifest around the tensors.
Never prints: progress goes through a callback, the result is a summary dict.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mocli import trace
from mocli.checkpoint import Checkpoint
from mocli.errors import InputError, Refused
from mocli.formats import provenance_block
from mocli.io.digests import SourceDigests
from mocli.io.shard_writer import DEFAULT_MAX_SHARD_BYTES, group_layouts
from mocli.parallel import Heads, ParallelLayout
from mocli.targets import Target


def convert(ckpt: Checkpoint, out: Path, target: Target, device: str = "auto", overwrite: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress=None, tp: int = 1, ep: int = 1,
            digests: SourceDigests | None = None, dist=None, mxfp4_experts: str = "native") -> dict[str, Any]:
    """Convert ``ckpt`` for ``target`` (at ``tp``/``ep`` ranks) into ``out``; returns the summary.
    ``mxfp4_experts`` "fp8-block": MXFP4 experts re-encoded as 128x128 block FP8 (``mocli.targets.experts``).

    Nothing imports torch: every unit of a conversion is ``torch_free`` (bytes copied or moved, FP8
    shards requantized and NVFP4 block scales rescaled through 256-entry tables, in numpy on the CPU),
    so it runs on the CPU whatever ``device`` says, and the summary says so where a GPU was asked for."""
    from mocli import stream
    from mocli.devices import check_device
    from mocli.formats import layout
    from mocli.plan import build_plan
    from mocli.scales import read_scales
    from mocli.validate import validate

    digests = digests or SourceDigests([h.path for h in ckpt.files])
    t0 = time.perf_counter()
    progress = progress or stream.Progress()
    dist = dist or stream.Dist()
    out = Path(out)
    parallel, reencoded = _options(target, tp, ep, mxfp4_experts)
    ckpt.require_convertible()
    stream.check_output(out, overwrite, ckpt.path)
    progress.phase("planning")
    census = ckpt.census()
    scales = read_scales(census)
    trace.mark("census taken, scales read")
    report = validate(ckpt, target, census, scales, parallel=parallel, mxfp4_experts=mxfp4_experts)
    if report.findings.errors:
        raise Refused(report.findings)
    trace.mark("validated and planned")

    # validate planned it to judge what it computes (SCL006): the same census, scales, target and ranks
    plan = report.plan or build_plan(census, scales, target, parallel, Heads.from_config(ckpt.config), mxfp4_experts)
    layouts = group_layouts(list(plan.tensors.values()), max_shard_bytes)
    fp = stream.fingerprint("convert", ckpt.files, layouts, {
        "layout_version": layout.LAYOUT_VERSION, "target": str(target), "parallel": parallel.to_dict(),
        "tensors": {f"{g}/{n}": t.to_dict() for (g, n), t in plan.tensors.items()}, **reencoded})
    body = layout.manifest_body(plan, target, parallel, ckpt.quant.kv_cache_algo if ckpt.quant else None)

    def finish(partial: Path, files: dict[str, str]) -> None:
        provenance = provenance_block(ckpt.source, digests.result(), target=str(target),
                                      layout_version=layout.LAYOUT_VERSION, layout=layout.MANIFEST_NAME,
                                      parallel=parallel.to_dict(), **reencoded)
        layout.write_layout(partial, ckpt.path, body, layouts, files, provenance)

    check_device(device)  # refused before anything is written (the driver answered while we planned)
    job = stream.Job("convert", out, ckpt.path, plan, layouts, fp, finish, overwrite=overwrite, device=device,
                     progress=progress, dist=dist, source_digests=digests,
                     args={"--target": target, "--tp": tp, "--ep": ep, "--max-shard-size": max_shard_bytes,
                           **({"--mxfp4-experts": str(mxfp4_experts)} if reencoded else {})})
    return _summary(out, target, reencoded, stream.run(job), plan, parallel, report, time.perf_counter() - t0)


def _options(target: Target, tp: int, ep: int, mxfp4_experts: str) -> tuple[ParallelLayout, dict[str, str]]:
    """The ranks, and what the manifest records of ``--mxfp4-experts`` (nothing for the default: its outputs are
    byte for byte what they were before the option existed); a usage error for what cannot be."""
    if tp < 1 or ep < 1:
        raise InputError(f"--tp {tp} --ep {ep}: sizes must be at least 1", hint="e.g. --tp 8, or --tp 2 --ep 2")
    reencoded = {} if mxfp4_experts == "native" else {"mxfp4_experts": str(mxfp4_experts)}
    if reencoded:
        from mocli.targets.experts import check_choice

        check_choice(target, mxfp4_experts)
    return ParallelLayout(tp, ep), reencoded


def _summary(out: Path, target: Target, reencoded: dict, result, plan, parallel: ParallelLayout, report,
             seconds: float) -> dict[str, Any]:
    return {
        "output": str(out), "target": str(target), **reencoded, **result.device_fields(), "tensors": len(plan.tensors),
        "parallel": parallel.to_dict(), "bytes": result.bytes, "shards": len(result.files),
        "units": result.units, "resumed_units": result.resumed_units, "modules": len(plan.modules),
        "seconds": round(seconds, 3), "unified_scales": plan.unified_scales,
        # the key's name before this release (repair's own "repairs" is a list of another shape): kept one release
        "repairs": plan.unified_scales,
        # VLL001 says stock vLLM refuses the source: the output serves through mocli's plugin
        "warnings": [f.to_dict() for f in report.findings.warnings if f.code != "VLL001"],
        "discarded_partial_bytes": result.discarded_partial,
    }
