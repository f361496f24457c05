"""``mocli verify``: prove an output right, byte by byte and with real GEMMs.

What the directory is decides how (``formats.detect``, one verifier per output format in
``VERIFIERS``). A ``mocli convert`` output, in order: the files the manifest declares, its records
against each other (``formats.layout_audit``), every output file against its digest and the source
against the digest recorded at conversion (in the background), then every module on every checked
rank by its kind's check (``mocli.verify.modules``), the cross-rank properties of SEMANTICS §10,
pass-through tensors byte for byte against the source, and finally that nothing is missing and no
tensor went unchecked.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from mocli import trace
from mocli.checkpoint import Checkpoint
from mocli.devices import requested_device
from mocli.errors import InputError
from mocli.formats import DirKind, detect
from mocli.formats.layout import Layout, read_layout
from mocli.loader import open_converted
from mocli.progress import ModuleProgress as Progress
from mocli.targets import layout_of
from mocli.verify.complete import completeness
from mocli.verify.files import Hashes, compare_bytes, inventory, open_source
from mocli.verify.modules import check_modules, torch_runtime
from mocli.verify.results import VerifyOptions


def _verify_quantized(out: Path, opts: VerifyOptions, progress: Progress) -> dict[str, Any]:
    from mocli.verify.quantized import verify_quantized

    return verify_quantized(out, opts, progress)


def _verify_repaired(out: Path, opts: VerifyOptions, progress: Progress) -> dict[str, Any]:
    from mocli.verify.repaired import verify_repaired

    return verify_repaired(out, opts, progress)


def _verify_layout(out: Path, opts: VerifyOptions, progress: Progress) -> dict[str, Any]:
    return verify_layout(read_layout(out), opts, progress)


def _not_an_output(out: Path, opts: VerifyOptions, progress: Progress) -> dict[str, Any]:
    raise InputError(f"{out}: no mocli-layout.json; not a mocli-converted checkpoint",
                     hint="verify takes what mocli convert, quantize or repair wrote; run mocli convert first")


VERIFIERS = {DirKind.LAYOUT: _verify_layout, DirKind.QUANTIZED: _verify_quantized,
             DirKind.REPAIRED: _verify_repaired, DirKind.CHECKPOINT: _not_an_output}


def verify(out: str | Path, opts: VerifyOptions, progress: Progress | None = None, kind: DirKind | None = None,
           layout: Layout | None = None) -> dict[str, Any]:
    """``kind`` (``formats.detect``) and ``layout`` (a LAYOUT's manifest): what the caller found already,
    so that the directory is identified and its manifest read once."""
    out, progress = Path(out), progress or Progress()
    progress.phase("reading the manifest")
    kind = kind or detect(out)
    if kind is DirKind.LAYOUT:
        return verify_layout(layout or read_layout(out), opts, progress)
    return VERIFIERS[kind](out, opts, progress)


def verify_layout(layout: Layout, opts: VerifyOptions, progress: Progress) -> dict[str, Any]:
    t_all = time.perf_counter()
    out = layout.path
    n_ranks = len(layout.rank_ids)
    if opts.rank is not None and not 0 <= opts.rank < n_ranks:
        raise InputError(f"--rank {opts.rank}: {out} has ranks 0..{n_ranks - 1}", hint="pick an existing rank")
    ranks = [opts.rank] if opts.rank is not None else list(range(n_ranks))
    inv = inventory(layout, ranks)
    provenance = layout.provenance or {}
    src = open_source(out, provenance, opts)
    trace.mark("source headers read")
    hashes = Hashes(out, inv.wanted, provenance.get("source_shards") or {}, src, opts, record_name="")
    census = src.census()
    found: dict[str, Any] = {"completeness": completeness(layout, census, ranks)}
    cks = {r: open_converted(layout, rank=layout.rank_id(r)) for r in ranks if r not in inv.broken_ranks}
    side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mocli-verify-passthrough")
    try:
        found["layout"] = _layout_problems(layout, cks)
        names = _names(cks, opts, skip=bool(found["layout"]))
        kinds = {ck.module_entry(n).kind for ck in cks.values() for n in names if ck.holds(n)}
        trace.mark("census taken, outputs opened")
        rt = torch_runtime(kinds, layout_of(layout.target), opts)
        progress.start(len(names) * len(cks))
        # pass-through tensors compared on a thread beside the module checks (reads and numpy compares drop
        # the GIL; the checks run in worker processes or GEMMs): on the H200 the 0.5 GB of a compressed-
        # tensors MXFP4 output's took 0.33 s after its six MoE layers' checks, which kept 6 of 14 workers busy
        top_missing = any("/" not in p["file"] for p in inv.problems if "missing" in p["problem"])
        passthrough = side.submit(_passthrough, layout, src) if not top_missing else None
        trace.mark(f"checking {len(names)} modules on {len(cks)} rank(s)" + ("" if rt else ", without torch"))
        found["results"], found["cross"] = check_modules(names, cks, src, census, layout_of(layout.target), rt,
                                                         opts, layout.parallel.tp, progress)
        progress.phase("pass-through tensors")
        found["passthrough"] = passthrough.result() if passthrough else (0, [])
        found["coverage"] = _coverage(cks, layout, opts)
        progress.phase(f"hashing {hashes.count} files")
        found["files"] = inv.problems + hashes.result()
        trace.mark("hashes checked")
    finally:
        side.shutdown(wait=True, cancel_futures=True)  # its readers closed before the outputs' go
        hashes.close()
        for ck in cks.values():
            ck.close()
    return _report(layout, src, ranks, rt, opts, len(inv.wanted or {}), found, t_all)


def _names(cks: dict, opts: VerifyOptions, skip: bool) -> list[str]:
    """Every module any checked rank holds, in the manifest's order (one missing on a rank is
    completeness's), that ``--layers`` selects; none where the records contradict each other (``skip``:
    no module check can trust them; the files are still hashed)."""
    names = list(dict.fromkeys(n for ck in cks.values() for n in ck.module_names))
    names = [n for n in names if opts.layers is None or fnmatchcase(n, opts.layers)]
    if not names and opts.layers is not None:
        raise InputError(f"--layers {opts.layers!r} matches no converted module",
                         hint="names look like model.layers.0.self_attn.qkv_proj; use * wildcards")
    return [] if skip else names


def _report(layout: Layout, src: Checkpoint, ranks: list[int], rt, opts: VerifyOptions, files_checked: int,
            found: dict[str, Any], t_all: float) -> dict[str, Any]:
    results, cross = found["results"], found["cross"]
    n_pass, pass_problems = found["passthrough"]
    failures = [r for r in results if not r.passed] + [c for c in cross if not c.passed]
    failures += found["files"] + pass_problems + found["coverage"]["unchecked"] + found["completeness"] + found["layout"]
    return {
        "output": str(layout.path), "source": src.source.describe(), "target": str(layout.target),
        "parallel": layout.parallel.to_json(), "ranks": ranks, "device": str(rt.device) if rt else "cpu",
        **({} if rt else _cpu_note(opts.device)), "tokens": opts.tokens, "seed": opts.seed,
        "files": {"checked": files_checked, "problems": found["files"]},
        "modules": [r.to_dict() for r in results], "cross_rank": [c.to_dict() for c in cross],
        "passthrough": {"checked": n_pass, "problems": pass_problems}, "coverage": found["coverage"],
        "completeness": {"problems": found["completeness"]}, "layout": {"problems": found["layout"]},
        "passed": sum(r.passed for r in results), "failed": len(failures),
        "ok": not failures, "seconds": round(time.perf_counter() - t_all, 3),
    }


def _layout_problems(layout: Layout, cks: dict) -> list[str]:
    """What the directory's own records say against each other (``formats.layout_audit``): everything
    mocli's vLLM plugin refuses before loading fails here too."""
    from mocli.formats.layout_audit import config_problems, module_problems, tensor_problems

    problems = config_problems(layout.path, layout) + module_problems(layout)
    for r, ck in cks.items():
        problems += tensor_problems(layout, layout.rank_id(r), ck.entries)
    return problems


def _cpu_note(device: str) -> dict[str, str]:
    """Where a GPU was asked for (or ``auto`` found one) but the checks ran in numpy on the CPU."""
    wanted = requested_device(device)
    return {"device_requested": wanted} if wanted != "cpu" else {}


def _passthrough(layout: Layout, src: Checkpoint) -> tuple[int, list[dict[str, str]]]:
    """Top-level pass-through tensors are the source's bytes, compared in chunks."""
    from mocli.formats import INDEX_NAME
    from mocli.formats.layout import group_entries
    from mocli.io.safetensors_file import TensorReader

    out, names = layout.path, layout.passthrough()
    entries = group_entries(out, "") if (out / INDEX_NAME).exists() else {}
    missing = [{"tensor": n, "problem": "declared by the manifest but in no top-level shard"} for n in names
               if n not in entries]
    with TensorReader(follow=False) as out_reader, src.reader() as src_reader:
        return len(names), missing + compare_bytes({n: entries[n] for n in names if n in entries}, src, out_reader,
                                                   src_reader)


def _coverage(cks: dict, layout: Layout, opts: VerifyOptions) -> dict[str, Any]:
    """Every tensor in the checked files is either a module's (checked above) or pass-through."""
    passthrough = set(layout.passthrough())
    total, unchecked = 0, []
    for ck in cks.values():
        covered = set(passthrough)
        for name in ck.module_names:
            covered |= set(ck.module_entry(name).tensors.values())
        for name in ck.entries:
            total += 1
            if name not in covered:
                unchecked.append(name)
    filtered = opts.layers is not None
    return {"tensors": total, "unchecked": [] if filtered else sorted(set(unchecked))[:20],
            "note": "--layers restricts the module checks" if filtered else ""}
