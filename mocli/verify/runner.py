"""``mocli verify``: prove a converted directory right, byte by byte and with real GEMMs.

In order: every output file against the SHA-256 in the manifest; the source against the SHA-256
recorded at conversion; then per module and rank the checks of ``mocli.verify.modules`` (bytes of
every weight and scale, consistency of every derived scale, kernel numerics); the cross-rank
properties of SEMANTICS §10; pass-through tensors byte for byte against the source; and finally
that no tensor in the output went unchecked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch

from mocli.census import build_census
from mocli.checkpoint import Checkpoint, open_checkpoint
from mocli.errors import InputError
from mocli.io.digests import sha256_file
from mocli.kinds import KINDS, ModuleKind
from mocli.loader import open_converted, read_manifest
from mocli.targets import Target, layout_of
from mocli.verify.expect import heads_of
from mocli.verify.modules import CrossResult, ModuleResult, Runtime, Source, check_dense, check_moe


@dataclass
class VerifyOptions:
    source: str | None = None
    device: str = "auto"
    kernels: str = "auto"
    layers: str | None = None
    tokens: int = 64
    seed: int = 0
    rank: int | None = None
    check_source_hash: bool = True


@dataclass
class Progress:
    start: Callable[[int], None] = lambda total: None
    advance: Callable[[], None] = lambda: None
    phase: Callable[[str], None] = lambda label: None
    results: list[ModuleResult] = field(default_factory=list)


def _runtime(opts: VerifyOptions, target: str) -> Runtime:
    if opts.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif opts.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available", hint="use --device cpu")
    else:
        dev = torch.device(opts.device)
    # quantize's output has no kernel layout (the engine loads it as it is): no target registry entry
    rt = Runtime(dev, opts.kernels, target, layout_of(target) if target in {t.value for t in Target} else None)
    if rt.cuda:
        rt.cc = torch.cuda.get_device_capability(dev)
    if opts.kernels != "torch" and rt.cuda:  # FlashInfer kernels are CUDA-only: skip the (slow) import
        try:
            import flashinfer  # noqa: F401

            rt.fi = flashinfer
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            rt.fi = None
    if opts.kernels == "flashinfer" and (rt.fi is None or not rt.cuda):
        raise InputError("--kernels flashinfer needs flashinfer-python and a CUDA device",
                         hint="pip install 'mocli[flashinfer]' on a GPU machine, or use --kernels torch")
    return rt


def _source_spec(out: Path, manifest: dict, opts: VerifyOptions) -> str:
    recorded = (manifest.get("provenance") or {}).get("source") or {}
    spec = opts.source or recorded.get("path") or (
        f"{recorded['repo_id']}@{recorded['revision']}" if recorded.get("repo_id") else None)
    if spec is None:
        raise InputError(f"{out}: provenance records no source", hint="pass --source MODEL")
    return spec


class _Hashes:
    """Output files against their recorded SHA-256 and source shards against provenance, hashed on
    every core in the background while the module checks run (hashlib drops the GIL)."""

    def __init__(self, out: Path, wanted: dict[str, str] | None, recorded: dict[str, str], src: Checkpoint,
                 opts: VerifyOptions, record_name: str = "mocli-layout.json") -> None:
        self.out, self.src = out, src
        self.problems: list[dict[str, str]] = []
        self.wanted = wanted or {}
        self.recorded = recorded
        if wanted is None:
            self.problems.append({"file": str(out / record_name),
                                  "problem": "records no file digests (written by an older mocli); run it again"})
        have = {h.path.name: h.path for h in src.files}
        if opts.check_source_hash and set(self.recorded) != set(have):
            raise InputError(f"{src.source.describe()}: source shards {sorted(have)} differ from those recorded at "
                             f"conversion {sorted(self.recorded)}", hint="verify against the checkpoint that was converted")
        jobs = [("out", rel, out / rel) for rel in self.wanted]
        if opts.check_source_hash:
            jobs += [("src", name, have[name]) for name in self.recorded]
        jobs.sort(key=lambda j: -(j[2].stat().st_size if j[2].exists() else 0))
        self.count = len(jobs)
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
        self.futures = [(job, self.pool.submit(self._one, job[2])) for job in jobs]

    @staticmethod
    def _one(path: Path) -> tuple[str | None, str | None]:
        try:
            return sha256_file(path), None
        except OSError as e:
            return None, e.strerror or str(e)

    def result(self) -> list[dict[str, str]]:
        """File problems of the output; raises InputError when the source changed since conversion."""
        try:
            for (kind, name, _), fut in self.futures:
                digest, err = fut.result()
                if kind == "out":
                    if err is not None:
                        self.problems.append({"file": name, "problem": f"cannot read: {err}"})
                    elif digest != self.wanted[name]:
                        self.problems.append({"file": name, "problem": "SHA-256 differs from the manifest: the file "
                                              "changed after conversion"})
                elif err is not None or digest != self.recorded[name]:
                    raise InputError(f"{self.src.source.describe()}: {name} no longer matches the SHA-256 recorded at "
                                     "conversion", hint="the source changed since conversion; convert again or pass "
                                     "the original --source")
        finally:
            self.pool.shutdown(cancel_futures=True)
        return self.problems


def _quantized_output(out: Path) -> bool:
    """A directory mocli quantize wrote: config.json says quant_method fp8 with mocli provenance."""
    from mocli.io.jsonfile import read_json

    cfg = out / "config.json"
    if not cfg.is_file():
        return False
    data = read_json(cfg)
    q = data.get("quantization_config") if isinstance(data, dict) else None
    return isinstance(q, dict) and q.get("quant_method") == "fp8" and isinstance(q.get("mocli"), dict)


def _passthrough(out: Path, manifest: dict, src: Checkpoint) -> tuple[int, list[dict[str, str]]]:
    """Top-level pass-through tensors are the source's bytes, compared in chunks."""
    ck = open_converted(out, rank=0 if manifest.get("ranks") else None)
    names = [n for n, t in manifest["tensors"].items() if t.get("role") == "passthrough"]
    try:
        return len(names), compare_bytes({n: ck.entry(n) for n in names}, src, ck._reader)
    finally:
        ck.close()


def compare_bytes(entries: dict, src: Checkpoint, reader) -> list[dict[str, str]]:
    """Each output entry equals the source tensor of the same name, byte for byte (chunked reads)."""
    problems, chunk = [], 16 << 20
    for name, e_out in entries.items():
        e_src = src.tensors.get(name)
        if e_src is None or (e_out.dtype, e_out.shape) != (e_src.dtype, e_src.shape):
            problems.append({"tensor": name, "problem": "has no source tensor of that name, dtype and shape"})
            continue
        fo, fs = reader.fd(e_out.file), reader.fd(e_src.file)
        for a in range(0, e_out.nbytes, chunk):
            n = min(chunk, e_out.nbytes - a)
            if os.pread(fo, n, e_out.start + a) != os.pread(fs, n, e_src.start + a):
                problems.append({"tensor": name, "problem": f"differs from the source (bytes {a}..{a + n})"})
                break
    return problems


def verify(out: str | Path, opts: VerifyOptions, progress: Progress | None = None) -> dict[str, Any]:
    t_all = time.perf_counter()
    out = Path(out)
    progress = progress or Progress()
    progress.phase("reading the manifest")
    if not (out / "mocli-layout.json").exists() and _quantized_output(out):
        from mocli.verify.quantized import verify_quantized

        return verify_quantized(out, opts, progress)
    manifest = read_manifest(out)
    parallel = manifest.get("parallel") or {"tp": 1, "ep": 1, "ranks": 1}
    n_ranks = len(manifest.get("ranks") or [None])
    if opts.rank is not None and not 0 <= opts.rank < n_ranks:
        raise InputError(f"--rank {opts.rank}: {out} has ranks 0..{n_ranks - 1}", hint="pick an existing rank")
    ranks = [opts.rank] if opts.rank is not None else list(range(n_ranks))
    groups = [""] + ([manifest["ranks"][r]["dir"] for r in ranks] if manifest.get("ranks") else [])
    src = open_checkpoint(_source_spec(out, manifest, opts))
    files = manifest.get("files")
    wanted = None if not isinstance(files, dict) else {
        rel: info.get("sha256") for rel, info in files.items() if (rel.split("/", 1)[0] if "/" in rel else "") in groups}
    hashes = _Hashes(out, wanted, (manifest.get("provenance") or {}).get("source_shards") or {}, src, opts)
    census = build_census(src.tensors)
    rt = _runtime(opts, manifest["target"])
    heads = heads_of(src.config)
    cks = {r: open_converted(out, rank=r if manifest.get("ranks") else None) for r in ranks}
    names = [m["name"] for m in cks[ranks[0]]._module_info.values()]
    names = [n for n in names if opts.layers is None or fnmatchcase(n, opts.layers)]
    if not names:
        raise InputError(f"--layers {opts.layers!r} matches no converted module",
                         hint="names look like model.layers.0.self_attn.qkv_proj; use * wildcards")
    results: list[ModuleResult] = []
    cross: list[CrossResult] = []
    progress.start(len(names) * len(ranks))
    try:
        with src.reader() as reader:
            source = Source(src, census, reader, rt.device)
            for name in names:
                infos = {r: cks[r].module_info(name) for r in ranks}
                kind = ModuleKind(next(iter(infos.values()))["kind"])
                check = check_moe if KINDS[kind].moe else check_dense
                args = (name, infos, cks, source, rt, opts) + (() if KINDS[kind].moe else (parallel["tp"], heads))
                res, cr = check(*args)
                results += res
                if cr is not None:
                    cross.append(cr)
                for _ in res:
                    progress.advance()
                reader.drop_pages()  # RSS: one module's mapped bytes at a time, not the model's
                for ck in cks.values():
                    ck.drop_pages()
        progress.phase("pass-through tensors")
        n_pass, pass_problems = _passthrough(out, manifest, src)
        coverage = _coverage(cks, manifest, names, opts)
        progress.phase(f"hashing {hashes.count} files")
        file_problems = hashes.result()
    finally:
        hashes.pool.shutdown(cancel_futures=True)
        for ck in cks.values():
            ck.close()
    failed = [r for r in results if not r.passed]
    failed_cross = [c for c in cross if not c.passed]
    ok = not (failed or failed_cross or file_problems or pass_problems or coverage["unchecked"])
    return {
        "output": str(out), "source": src.source.describe(), "target": manifest["target"],
        "parallel": parallel, "ranks": ranks, "device": str(rt.device), "tokens": opts.tokens, "seed": opts.seed,
        "files": {"checked": len([1 for f in (manifest.get("files") or {})
                                  if (f.split("/", 1)[0] if "/" in f else "") in groups]), "problems": file_problems},
        "modules": [r.to_dict() for r in results], "cross_rank": [c.to_dict() for c in cross],
        "passthrough": {"checked": n_pass, "problems": pass_problems}, "coverage": coverage,
        "passed": len(results) - len(failed), "failed": len(failed) + len(failed_cross) + len(file_problems)
        + len(pass_problems) + len(coverage["unchecked"]),
        "ok": ok, "seconds": round(time.perf_counter() - t_all, 3),
    }


def _coverage(cks: dict, manifest: dict, names: list[str], opts: VerifyOptions) -> dict[str, Any]:
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
