"""Whole files and verbatim tensors: output digests against the record, the source against provenance,
and tensors that must be the source's bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mocli.checkpoint import Checkpoint
from mocli.errors import InputError
from mocli.formats.manifest import Layout
from mocli.io.digests import BackgroundDigests, as_record
from mocli.verify.results import VerifyOptions


class Hashes:
    """Output files against their recorded digests and source shards against provenance, hashed in the
    background while the module checks run (the hashers drop the GIL; BLAKE3 spreads one large file
    over every core). A digest is recorded with its algorithm (``{"xxh3_128": hex}``, ``{"blake3": hex}``;
    outputs written before records recorded a bare SHA-256), and checked with that algorithm."""

    def __init__(self, out: Path, wanted: dict[str, Any] | None, recorded: dict[str, Any], src: Checkpoint,
                 opts: VerifyOptions, record_name: str = "mocli-layout.json") -> None:
        self.out, self.src = out, src
        self.problems: list[dict[str, str]] = []
        self.wanted = {rel: as_record(v) for rel, v in (wanted or {}).items()}
        self.recorded = {name: as_record(v) for name, v in recorded.items()}
        if wanted is None and record_name:
            self.problems.append({"file": str(out / record_name),
                                  "problem": "records no file digests (written by an older mocli); run it again"})
        bad = [n for n, r in {**self.wanted, **self.recorded}.items() if r is None]
        if bad:
            raise InputError(f"{out}: the digest recorded for {bad[0]!r} is not a digest record",
                             hint="the record is damaged or hostile; convert again")
        have = {h.path.name: h.path for h in src.files}
        if opts.check_source_hash and set(self.recorded) != set(have):
            raise InputError(f"{src.source.describe()}: source shards {sorted(have)} differ from those recorded at "
                             f"conversion {sorted(self.recorded)}", hint="verify against the checkpoint that was converted")
        # the output's files are read as they are (no link); the source may be a Hugging Face cache of links
        jobs = [("out", rel, out / rel, self.wanted[rel][0], False) for rel in self.wanted]
        if opts.check_source_hash:
            jobs += [("src", name, have[name], self.recorded[name][0], True) for name in self.recorded]
        jobs.sort(key=lambda j: -(j[2].stat().st_size if j[2].exists() else 0))
        self.count = len(jobs)
        # digests started before torch was imported (opts.early_digests) are used where they are the same
        # file, algorithm and link rule; the rest are started here
        early = opts.early_digests
        taken = [early.take(*job[2:]) if early is not None else None for job in jobs]
        self.digests = BackgroundDigests([job[2:] for job, fut in zip(jobs, taken, strict=True) if fut is None])
        self.futures = [(job, fut or self.digests.take(*job[2:])) for job, fut in zip(jobs, taken, strict=True)]

    def close(self) -> None:
        self.digests.shutdown()

    def result(self) -> list[dict[str, str]]:
        """File problems of the output; raises InputError when the source changed since conversion."""
        try:
            for (kind, name, _, algo, _), fut in self.futures:
                digest, err = fut.result()
                if kind == "out":
                    if err is not None:
                        self.problems.append({"file": name, "problem": f"cannot read: {err}"})
                    elif digest != self.wanted[name][1]:
                        self.problems.append({"file": name, "problem": f"{algo} digest differs from the record: "
                                              "the file changed after it was written"})
                elif err is not None or digest != self.recorded[name][1]:
                    raise InputError(f"{self.src.source.describe()}: {name} no longer matches the {algo} digest "
                                     "recorded at conversion", hint="the source changed since conversion; convert "
                                     "again or pass the original --source")
        finally:
            self.close()
        return self.problems


COMPARE_CHUNK = 16 << 20


def compare_bytes(entries: dict, src: Checkpoint, out_reader, src_reader) -> list[dict[str, str]]:
    """Each output entry equals the source tensor of the same name, byte for byte (chunked reads). Two
    readers, two link rules: a mocli output holds no link, a source may be a Hugging Face cache snapshot
    of links into ``../../blobs``. Each chunk is read into the same two buffers and compared 8 bytes at a
    time in numpy, which drops the GIL (a fresh ``bytes`` per read faulted in new memory every time: the
    0.5 GB of pass-through tensors took 0.33 s of a 2.1 s verify on the H200); a file shorter than its
    header says reads as a difference."""
    import numpy as np

    problems = []
    bufs, same = np.empty((2, COMPARE_CHUNK), dtype=np.uint8), np.empty(COMPARE_CHUNK // 8, dtype=bool)
    for name, e_out in entries.items():
        e_src = src.tensors.get(name)
        if e_src is None or (e_out.dtype, e_out.shape) != (e_src.dtype, e_src.shape):
            problems.append({"tensor": name, "problem": "has no source tensor of that name, dtype and shape"})
            continue
        for a in range(0, e_out.nbytes, COMPARE_CHUNK):
            n = min(COMPARE_CHUNK, e_out.nbytes - a)
            x, y = bufs[0, :n], bufs[1, :n]
            if not (out_reader.read_range(e_out, a, memoryview(x), short_ok=True)
                    and src_reader.read_range(e_src, a, memoryview(y), short_ok=True) and _equal(x, y, same)):
                problems.append({"tensor": name, "problem": f"differs from the source (bytes {a}..{a + n})"})
                break
    return problems


def _equal(x, y, same) -> bool:
    """Two uint8 arrays alike, as 64-bit words into the scratch ``same`` and the tail byte by byte."""
    import numpy as np

    w = len(x) // 8
    if w and not np.equal(x[:8 * w].view(np.uint64), y[:8 * w].view(np.uint64), out=same[:w]).all():
        return False
    return bytes(x[8 * w:]) == bytes(y[8 * w:])


def open_source(out: Path, provenance: dict, opts) -> Checkpoint:
    """The checkpoint an output was made from: ``--source``, else what its provenance recorded."""
    from mocli.checkpoint import open_checkpoint
    from mocli.formats import source_spec

    spec = source_spec(provenance, opts.source)
    if spec is None:
        raise InputError(f"{out}: provenance records no source", hint="pass --source MODEL")
    return open_checkpoint(spec)


@dataclass
class Inventory:
    """What an output directory holds against what its manifest declares."""

    wanted: dict[str, str] | None  # relative path -> recorded digest, for the files of the checked groups
    problems: list[dict[str, str]] = field(default_factory=list)
    broken_ranks: set[int] = field(default_factory=set)  # ranks with a file missing or not regular


def inventory(layout: Layout, ranks: list[int]) -> Inventory:
    """Every declared file present and regular, every declared rank's directory there, and (layout 2)
    nothing in OUT that the manifest does not cover. Names that leave OUT or pass through a link are
    refused (exit 2) before anything is read."""
    from mocli.formats.layout import MANIFEST_NAME, file_path
    from mocli.io.paths import kind_of

    out, files, declared_ranks = layout.path, layout.files, layout.ranks
    groups = {""} | {declared_ranks[r].dir for r in ranks if declared_ranks}
    inv = Inventory(None if files is None else {})
    if files is None:
        inv.problems.append({"file": str(out / MANIFEST_NAME),
                             "problem": "records no file digests (written by an older mocli); convert again"})
        return inv
    rank_of = {e.dir: e.rank for e in declared_ranks}
    for rel, info in files.items():
        path = file_path(out, rel)
        group = rel.split("/", 1)[0] if "/" in rel else ""
        if not path.is_file() or path.is_symlink():
            inv.problems.append({"file": rel, "problem": "declared by the manifest but missing" if not path.exists()
                                 else f"declared by the manifest but {kind_of(os.lstat(path).st_mode)}"})
            if group in rank_of:
                inv.broken_ranks.add(rank_of[group])
            elif group == "":
                inv.broken_ranks.update(range(max(1, len(declared_ranks))))
        elif group in groups:
            inv.wanted[rel] = {k: v for k, v in info.items() if k != "size"}
    for entry in declared_ranks:
        if not (out / entry.dir).is_dir():
            inv.problems.append({"file": entry.dir, "problem": f"rank {entry.rank}'s directory is missing"})
            inv.broken_ranks.add(entry.rank)
    if layout.version >= 2:
        for path in sorted(out.rglob("*")):
            rel = str(path.relative_to(out))
            if path.is_symlink():
                raise InputError(f"{path}: a symbolic link inside a mocli output",
                                 hint="a mocli output holds no links; restore it from the original or convert again")
            if path.is_file() and rel != MANIFEST_NAME and rel not in files:
                inv.problems.append({"file": rel, "problem": "not covered by the manifest (added after conversion?)"})
    return inv
