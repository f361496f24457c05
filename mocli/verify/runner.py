"""``mocli verify``: prove a converted directory right, byte by byte and with real GEMMs.

In order: every output file against the digest in the manifest; the source against the digest
recorded at conversion; then per module and rank the checks of its kind (bytes of every weight and
scale, consistency of every derived scale, kernel numerics): ``nvfp4`` in numpy, ``dense`` and
``moe`` (FP8) in torch, which is imported only when a module needs it; the cross-rank properties of
SEMANTICS §10; pass-through tensors byte for byte against the source; and finally that no tensor
in the output went unchecked.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from mocli import trace
from mocli.census import build_census
from mocli.checkpoint import Checkpoint
from mocli.devices import Kernels, capability, check_device, requested_device
from mocli.errors import InputError
from mocli.formats.layout import read_manifest
from mocli.kinds import KINDS, ModuleKind
from mocli.loader import open_converted
from mocli.progress import ModuleProgress as Progress
from mocli.targets import layout_of
from mocli.verify import nvfp4
from mocli.verify.complete import completeness
from mocli.verify.expect import heads_of
from mocli.verify.files import Hashes, compare_bytes, inventory, open_source
from mocli.verify.results import CrossResult, ModuleResult, VerifyOptions


def verify(out: str | Path, opts: VerifyOptions, progress: Progress | None = None) -> dict[str, Any]:
    t_all = time.perf_counter()
    out = Path(out)
    progress = progress or Progress()
    progress.phase("reading the manifest")
    from mocli.formats.fp8 import provenance_of
    from mocli.formats.layout import is_layout

    if not is_layout(out) and provenance_of(out) is not None:
        from mocli.verify.quantized import verify_quantized

        return verify_quantized(out, opts, progress)
    from mocli.formats import modelopt

    if not is_layout(out) and modelopt.provenance_of(out) is not None:
        from mocli.verify.repaired import verify_repaired

        return verify_repaired(out, opts, progress)
    manifest = read_manifest(out)
    parallel = manifest["parallel"]
    n_ranks = len(manifest.get("ranks") or [None])
    if opts.rank is not None and not 0 <= opts.rank < n_ranks:
        raise InputError(f"--rank {opts.rank}: {out} has ranks 0..{n_ranks - 1}", hint="pick an existing rank")
    ranks = [opts.rank] if opts.rank is not None else list(range(n_ranks))
    inv = inventory(out, manifest, ranks)
    src = open_source(out, manifest.get("provenance") or {}, opts)
    hashes = Hashes(out, inv.wanted, (manifest.get("provenance") or {}).get("source_shards") or {}, src, opts,
                    record_name="")
    census = build_census(src.tensors)
    complete = completeness(manifest, census, ranks)
    intact = [r for r in ranks if r not in inv.broken_ranks]
    cks = {r: open_converted(out, rank=r if manifest.get("ranks") else None) for r in intact}
    layout_findings = _layout_problems(out, manifest, cks)
    # every module any checked rank holds, in the manifest's order (one missing on a rank is completeness's)
    names = list(dict.fromkeys(n for ck in cks.values() for n in ck._module_info))
    names = [n for n in names if opts.layers is None or fnmatchcase(n, opts.layers)]
    if not names and opts.layers is not None:
        raise InputError(f"--layers {opts.layers!r} matches no converted module",
                         hint="names look like model.layers.0.self_attn.qkv_proj; use * wildcards")
    if layout_findings:  # the records contradict each other: no module check can trust them (files are hashed)
        names = []
    layout = layout_of(manifest["target"])
    kinds = {ModuleKind(ck.module_info(n)["kind"]) for ck in cks.values() for n in names if n in ck._module_info}
    rt = _torch_runtime(kinds, layout, opts)
    progress.start(len(names) * len(intact))
    trace.mark(f"checking {len(names)} modules on {len(intact)} rank(s)" + ("" if rt else ", without torch"))
    try:
        results, cross = _check_modules(names, cks, src, census, layout, rt, opts, parallel["tp"], progress)
        progress.phase("pass-through tensors")
        top_missing = any("/" not in p["file"] for p in inv.problems if "missing" in p["problem"])
        n_pass, pass_problems = (0, []) if top_missing else _passthrough(out, manifest, src)
        coverage = _coverage(cks, manifest, opts)
        progress.phase(f"hashing {hashes.count} files")
        file_problems = inv.problems + hashes.result()
        trace.mark("hashes checked")
    finally:
        hashes.close()
        for ck in cks.values():
            ck.close()
    failed = [r for r in results if not r.passed]
    failed_cross = [c for c in cross if not c.passed]
    ok = not (failed or failed_cross or file_problems or pass_problems or coverage["unchecked"] or complete
              or layout_findings)
    return {
        "output": str(out), "source": src.source.describe(), "target": manifest["target"],
        "parallel": parallel, "ranks": ranks, "device": str(rt.device) if rt else "cpu",
        **({} if rt else _cpu_note(opts.device)), "tokens": opts.tokens, "seed": opts.seed,
        "files": {"checked": len(inv.wanted or {}), "problems": file_problems},
        "modules": [r.to_dict() for r in results], "cross_rank": [c.to_dict() for c in cross],
        "passthrough": {"checked": n_pass, "problems": pass_problems}, "coverage": coverage,
        "completeness": {"problems": complete}, "layout": {"problems": layout_findings},
        "passed": len(results) - len(failed), "failed": len(failed) + len(failed_cross) + len(file_problems)
        + len(pass_problems) + len(coverage["unchecked"]) + len(complete) + len(layout_findings),
        "ok": ok, "seconds": round(time.perf_counter() - t_all, 3),
    }


def _layout_problems(out: Path, manifest: dict[str, Any], cks: dict) -> list[str]:
    """What the directory's own records say against each other (``formats.layout_audit``): everything
    mocli's vLLM plugin refuses before loading fails here too."""
    from mocli.formats.layout_audit import config_problems, module_problems, tensor_problems

    problems = config_problems(out, manifest) + module_problems(manifest)
    for r, ck in cks.items():
        problems += tensor_problems(manifest, r if manifest.get("ranks") else None, ck._entries)
    return problems


def _torch_runtime(kinds: set[ModuleKind], layout, opts: VerifyOptions):
    """The torch runtime (``mocli.verify.common.runtime``) where a module needs torch: FP8 modules, or
    NVFP4 ones where FlashInfer's NVFP4 kernels may run (sm_100+, asked for or installed). None where
    every check runs in numpy: then torch is never imported, and ``--device`` is checked without it."""
    if kinds <= set(nvfp4.KINDS) and not _fp4_kernels_possible(layout, opts):
        check_device(opts.device)
        return None
    from mocli.verify.common import runtime

    return runtime(opts, layout)


def _fp4_kernels_possible(layout, opts: VerifyOptions) -> bool:
    """Whether FlashInfer's NVFP4 kernels could run: asked for, or a layout they read, FlashInfer
    installed and an sm_100+ device (SEMANTICS §9), all decided without torch (``Runtime.fp4_kernels``
    then decides for certain)."""
    import importlib.util

    kernels = Kernels(opts.kernels)
    if kernels is Kernels.FLASHINFER:
        return True  # the runtime checks that they can, and says why not
    if kernels is not Kernels.AUTO or not layout.fp4_kernels or opts.device == "cpu" \
            or importlib.util.find_spec("flashinfer") is None:
        return False
    cc = capability(opts.device)
    return cc is not None and cc[0] >= 10


def _cpu_note(device: str) -> dict[str, str]:
    """Where a GPU was asked for (or ``auto`` found one) but the checks ran in numpy on the CPU."""
    wanted = requested_device(device)
    return {"device_requested": wanted} if wanted != "cpu" else {}


def _module_bytes(cks: dict, name: str) -> int:
    """Bytes of the module's tensors on every rank that holds it: its checks' work goes with them (an
    MoE layer's expert bytes are compared and its sampled experts multiplied)."""
    return sum(ck.entry(t).nbytes for ck in cks.values() if name in ck._module_info
               for t in ck.module_info(name)["tensors"].values() if t in ck._entries)


def _in_order(futures: dict[str, Future], names: list[str]) -> Iterator:
    """The futures' results in ``names`` order, raising the first error of any of them as soon as it is
    raised (a module that fails stops the run, wherever it comes in the order)."""
    order = iter(names)
    name = next(order, None)
    for f in as_completed(futures.values()):
        f.result()  # an error: raised now
        while name is not None and futures[name].done():
            yield futures[name].result()
            name = next(order, None)


def _check_modules(names: list[str], cks: dict, src: Checkpoint, census, layout, rt, opts: VerifyOptions, tp: int,
                   progress: Progress) -> tuple[list[ModuleResult], list[CrossResult]]:
    """Every named module on every rank of ``cks`` that holds it, by its kind's check, in order (a module
    missing on a rank is completeness's finding, not a crash here). NVFP4 in numpy (torch only for
    FlashInfer's kernels), up to ``nvfp4.WORKERS`` modules at once; FP8 in torch (``rt``), one at a
    time. When a module is done the mapped pages go back (all maps': the modules still running fault
    theirs back in from the page cache)."""
    heads = heads_of(src.config)
    results: list[ModuleResult] = []
    cross: list[CrossResult] = []
    fp4 = nvfp4.Fp4Kernels(rt) if rt is not None and rt.fp4_kernels() else None
    with src.reader() as reader:
        np_source = nvfp4.NpSource(src, census, reader)
        source = None

        def check(name: str) -> tuple[list[ModuleResult], CrossResult | None]:
            trace.mark(f"{name}: started")
            try:
                return check_one(name)
            finally:  # RSS: the mapped bytes of the modules in flight, not the model's (every map's pages
                trace.mark(f"{name}: done")
                reader.drop_pages()  # go; a module still running faults its own back in from the page cache)
                for ck in cks.values():
                    ck.drop_pages()

        def check_one(name: str) -> tuple[list[ModuleResult], CrossResult | None]:
            nonlocal source
            infos = {r: ck.module_info(name) for r, ck in cks.items() if name in ck._module_info}
            kind = ModuleKind(next(iter(infos.values()))["kind"])
            if kind is ModuleKind.NVFP4_MOE:
                return nvfp4.check_moe(name, infos, cks, np_source, layout, opts, fp4)
            if kind is ModuleKind.NVFP4_LINEAR:
                return nvfp4.check_dense(name, infos, cks, np_source, layout, opts, tp, heads, fp4)
            from mocli.verify.common import Source
            from mocli.verify.dense import check_dense
            from mocli.verify.moe import check_moe

            source = source or Source(src, census, reader, rt.device)
            if KINDS[kind].moe:
                return check_moe(name, infos, cks, source, rt, opts)
            return check_dense(name, infos, cks, source, rt, opts, tp, heads)

        # numpy checks side by side where there are cores (nvfp4.WORKERS); torch's one at a time
        workers = nvfp4.WORKERS if rt is None else 1
        if workers == 1:
            done = (check(name) for name in names)
        else:  # the largest modules start first, so a long MoE layer does not start last (results in order)
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mocli-verify")
            futures = {name: pool.submit(check, name) for name in sorted(names, key=lambda n: -_module_bytes(cks, n))}
            done = _in_order(futures, names)
        try:
            for res, cr in done:
                results += res
                if cr is not None:
                    cross.append(cr)
                for _ in res:
                    progress.advance()
        finally:  # an error or Ctrl-C: the modules not started yet are not checked
            if workers > 1:
                pool.shutdown(wait=True, cancel_futures=True)
    return results, cross


def _passthrough(out: Path, manifest: dict, src: Checkpoint) -> tuple[int, list[dict[str, str]]]:
    """Top-level pass-through tensors are the source's bytes, compared in chunks."""
    from mocli.formats import INDEX_NAME
    from mocli.formats.layout import group_entries
    from mocli.io.safetensors_file import TensorReader

    names = [n for n, t in manifest["tensors"].items() if t.get("role") == "passthrough"]
    entries = group_entries(out, "") if (out / INDEX_NAME).exists() else {}
    missing = [{"tensor": n, "problem": "declared by the manifest but in no top-level shard"} for n in names
               if n not in entries]
    with TensorReader(follow=False) as out_reader, src.reader() as src_reader:
        return len(names), missing + compare_bytes({n: entries[n] for n in names if n in entries}, src, out_reader,
                                                   src_reader)


def _coverage(cks: dict, manifest: dict, opts: VerifyOptions) -> dict[str, Any]:
    """Every tensor in the checked files is either a module's (checked above) or pass-through."""
    passthrough = {n for n, t in manifest["tensors"].items() if t.get("role") == "passthrough"}
    total, unchecked = 0, []
    for ck in cks.values():
        covered = set(passthrough)
        for info in ck._module_info.values():
            covered |= set(info["tensors"].values())
        for name in ck._entries:
            total += 1
            if name not in covered:
                unchecked.append(name)
    filtered = opts.layers is not None
    return {"tensors": total, "unchecked": [] if filtered else sorted(set(unchecked))[:20],
            "note": "--layers restricts the module checks" if filtered else ""}
