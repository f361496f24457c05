"""Public API: load a converted directory into per-module objects holding what a FlashInfer call needs.

    from mocli.loader import load_converted
    ck = load_converted("out/", device="cuda")                 # tp = 1 output
    ck = load_converted("out-tp8/", rank=3, device="cuda:3")    # one rank of a --tp/--ep output
    moe = ck.modules["model.layers.0.mlp.experts"]              # Nvfp4MoE
    cutlass_fused_moe(..., quant_scales=moe.cutlass_quant_scales(), ...)

The layout contract is ``mocli/docs/LAYOUT.md``; ``mocli.formats.layout`` reads it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mocli.errors import CorruptFileError
from mocli.formats.layout import Layout, read_layout
from mocli.formats.manifest import ModuleEntry
from mocli.io.paths import open_regular
from mocli.io.safetensors_file import TensorEntry, TensorReader, tensor_bytes_view, torch_dtypes
from mocli.module_classes import (  # noqa: F401 - the public API names them from here
    CLASSES,
    ConvertedModule,
    Fp8BlockLinear,
    Fp8BlockMoE,
    Fp8ChannelLinear,
    Fp8Linear,
    Fp8MoE,
    MarlinLinear,
    MarlinMoE,
    Mxfp8Linear,
    Mxfp8MoE,
    Nvfp4Linear,
    Nvfp4MoE,
)

if TYPE_CHECKING:  # imported where tensors are made: opening an output and its numpy views need no torch
    import torch


@dataclass
class ConvertedCheckpoint:
    path: Path
    layout: Layout  # the manifest, read and checked once
    rank: int | None
    modules: dict[str, ConvertedModule]
    _reader: TensorReader
    _entries: dict[str, TensorEntry]
    _module_entries: dict[str, ModuleEntry]
    # every tensor of the rank outside the modules (embeddings, norms, routers...), by source name;
    # filled when load_converted loads everything
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return str(self.layout.target)

    @property
    def provenance(self) -> dict[str, Any]:
        return self.layout.provenance or {}

    @property
    def parallel(self) -> dict[str, Any]:
        return self.layout.parallel.to_json()

    @property
    def module_names(self) -> list[str]:
        """The rank's converted modules, in the manifest's order."""
        return list(self._module_entries)

    def holds(self, name: str) -> bool:
        return name in self._module_entries

    @property
    def entries(self) -> dict[str, TensorEntry]:
        """Every tensor of the rank (its shards and the shared ones), by name."""
        return self._entries

    def module_entry(self, name: str) -> ModuleEntry:
        """The module's manifest entry, typed (``ModuleEntry``: name, kind, scheme, tensors, sources, meta)."""
        return self._module_entries[name]

    def entry(self, name: str) -> TensorEntry:
        return self._entries[name]

    def tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Any of this rank's output tensors by name (the shared pass-through ones included)."""
        if name not in self._entries:
            raise KeyError(name)
        return self._reader.view(self._entries[name]).to(device)  # copy-free on the CPU

    def load_module(self, name: str, device: str | torch.device = "cpu",
                    tensors: dict[str, torch.Tensor] | None = None) -> ConvertedModule:
        """Build one module object from its manifest entry, tensors on ``device``."""
        import torch

        if tensors is None and torch.device(device).type == "cuda":
            # one span per file through pinned staging, not one pageable copy per tensor
            m = self.module_entry(name)
            tensors = load_tensors([self._entries[t] for t in m.tensors.values() if t in self._entries], device)
        return self._build(name, lambda t: tensors[t] if tensors is not None else self.tensor(t, device))

    def module_arrays(self, name: str) -> ConvertedModule:
        """``load_module`` with read-only numpy views of the files' pages in place of tensors (float8
        as its bytes, uint8), and no torch: what NVFP4 verify reads."""
        return self._build(name, lambda t: self._reader.array(self._entries[t]))

    def _build(self, name: str, fetch) -> ConvertedModule:
        m = self.module_entry(name)
        cls = CLASSES[m.kind]
        names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {"name": name}
        for role, tname in m.tensors.items():
            if role in names:
                if tname not in self._entries:
                    raise CorruptFileError(f"{self.path}: manifest names tensor '{tname}' that no shard holds",
                                           hint="the output is damaged; convert again")
                kwargs[role] = fetch(tname)
        kwargs |= {k: v for k, v in m.meta.items() if k in names}
        missing = [f.name for f in fields(cls) if f.name not in kwargs and f.default is MISSING]
        if missing:
            raise CorruptFileError(f"{self.path}: module '{name}' lacks {', '.join(missing)} in the manifest",
                                   hint="the output is damaged or from another mocli version; convert again")
        return cls(**kwargs)

    def drop_pages(self) -> None:
        """Give back the mapped pages that tensors on the CPU have touched (see TensorReader.drop_pages)."""
        self._reader.drop_pages()

    def close(self) -> None:
        self._reader.close()


def open_converted(path: str | Path | Layout, rank: int | None = None) -> ConvertedCheckpoint:
    """Manifest and headers of one rank, no tensor data yet (``path``: a directory, or a ``Layout`` whose
    manifest was read already, as verify hands each rank)."""
    layout = path if isinstance(path, Layout) else read_layout(path)
    _, modules, _ = layout.view(rank)
    return ConvertedCheckpoint(layout.path, layout, rank, {}, TensorReader(follow=False), layout.entries(rank),
                               {m.name: m for m in modules})


def load_converted(path: str | Path, device: str | torch.device = "cpu", modules: list[str] | None = None,
                   rank: int | None = None) -> ConvertedCheckpoint:
    """Read the manifest and the tensors of every (or the named; [] for none) module of ``rank``
    onto ``device``. Loading everything (``modules=None``) also fills ``ck.passthrough`` with the
    rank's other tensors, so a serving process has the whole rank, and reads each shard file once,
    straight into place."""
    ck = open_converted(path, rank)
    wanted = list(ck._module_entries) if modules is None else modules
    if not wanted and modules is not None:
        return ck
    in_modules = {t for n in wanted for t in ck.module_entry(n).tensors.values()}
    names = set(ck._entries) if modules is None else in_modules
    tensors = load_tensors([ck._entries[n] for n in sorted(names) if n in ck._entries], device)
    for name in wanted:
        ck.modules[name] = ck.load_module(name, device, tensors)
    if modules is None:
        ck.passthrough = {n: t for n, t in tensors.items() if n not in in_modules}
    return ck


# --- bulk loading ---------------------------------------------------------------------------------

STAGE = 64 << 20  # bytes per pinned staging buffer


def load_tensors(entries: list[TensorEntry], device: str | torch.device = "cpu",
                 follow: bool = False, stages: list | None = None) -> dict[str, torch.Tensor]:
    """Tensors for ``entries``, reading each file's needed span once.

    CPU: one buffer per file, tensors are views. CUDA: the file span goes through a ring of pinned
    staging buffers (filled by reader threads, pread drops the GIL) into one device allocation with
    asynchronous copies; tensors are views of it. Views whose offset does not suit their dtype's
    alignment (CUDA: 16 bytes, what tensor-core kernels need) are copied. ``follow``: whether the
    files may be symbolic links (a source in a Hugging Face cache; mocli's own outputs never).
    ``stages``: pinned staging buffers kept from an earlier call (taken from and given back to the list).
    """
    import torch

    device = torch.device(device)
    by_file: dict[Path, list[TensorEntry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    out: dict[str, torch.Tensor] = {}
    stages = [] if stages is None else stages  # reused from file to file, freed with the list
    for path, es in by_file.items():
        start = min(e.start for e in es)
        end = max(e.start + e.nbytes for e in es)
        if device.type == "cuda":
            buf = _read_to_device(path, start, end - start, device, follow, stages)
        else:
            buf = torch.empty(end - start, dtype=torch.uint8)
            _pread_into(path, start, tensor_bytes_view(buf), follow)
        dtypes = torch_dtypes()
        # safetensors pads its header to 8 bytes only, so tensors may start 8 bytes off a 16-byte boundary:
        # CUDA kernels (torch._scaled_mm, CUTLASS) need 16-byte aligned operands, the CPU its dtype's size
        cuda_align = 16 if device.type == "cuda" else 0
        for e in es:
            raw = buf[e.start - start: e.start - start + e.nbytes]
            dt = dtypes[e.dtype]
            if e.nbytes == 0:
                out[e.name] = torch.empty(e.shape, dtype=dt, device=device)
                continue
            if (e.start - start) % (cuda_align or dt.itemsize):
                raw = raw.clone()
            out[e.name] = raw.view(dt).view(e.shape)
    return out


def shard_into(entries: Iterable[TensorEntry], targets: Mapping[str, torch.Tensor],
               device: str | torch.device = "cpu") -> Iterator[dict[str, torch.Tensor]]:
    """Each file's tensors read once, in file order, straight into ``targets`` (name -> a contiguous tensor
    of the entry's dtype and shape on ``device``: a serving model's parameter) with no buffer between: on the
    CPU the file is read into the target's memory, on CUDA each pinned staging chunk is copied into the
    targets it overlaps. Yields, per file, its other tensors (on ``device``, each its own allocation)."""
    import torch

    device = torch.device(device)
    by_file: dict[Path, list[TensorEntry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    dtypes, stages = torch_dtypes(), []
    for file in sorted(by_file):
        es = sorted(by_file[file], key=lambda e: e.start)
        rest = {e.name: torch.empty(e.shape, dtype=dtypes[e.dtype], device=device) for e in es if e.name not in targets}
        dsts = [(e.start, e.nbytes, _flat_bytes(targets[e.name] if e.name in targets else rest[e.name]))
                for e in es if e.nbytes]
        if device.type == "cuda" and dsts:
            start = dsts[0][0]
            end = max(b + n for b, n, _ in dsts)
            _stream_to_device(file, start, end - start, device, False, stages, _scatter(dsts, start))
        else:
            _pread_spans(file, [(b, tensor_bytes_view(dst)) for b, _, dst in dsts])  # one descriptor per file
        yield rest
    stages.clear()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    if not t.is_contiguous():
        raise ValueError("shard_into needs contiguous targets")
    return t.reshape(-1).view(torch.uint8)


def _scatter(dsts: list[tuple[int, int, torch.Tensor]], start: int):
    """A ``_stream_to_device`` sink copying each staged chunk's bytes into the destinations it overlaps
    (``dsts``: file offset, size, flat byte view; sorted by offset, not overlapping)."""
    first = 0

    def sink(a: int, n: int, stage: torch.Tensor) -> None:
        nonlocal first
        lo, hi = start + a, start + a + n
        while first < len(dsts) and dsts[first][0] + dsts[first][1] <= lo:
            first += 1
        for b, size, dst in dsts[first:]:
            if b >= hi:
                break
            x, y = max(b, lo), min(b + size, hi)
            dst[x - b:y - b].copy_(stage[x - lo:y - lo], non_blocking=True)

    return sink


def _pread_into(path: Path, offset: int, view: memoryview, follow: bool = False) -> None:
    _pread_spans(path, [(offset, view)], follow)


def _pread_spans(path: Path, spans: list[tuple[int, memoryview]], follow: bool = False) -> None:
    """Each (offset, view) filled from the file, through one descriptor."""
    fd = open_regular(path, follow)
    try:
        for offset, view in spans:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise CorruptFileError(f"{path}: unexpected end of file", hint="the output is damaged; convert again")
                done += n
    finally:
        os.close(fd)


def _take_stages(kept: list, want: int) -> list:
    """``want`` pinned staging buffers, ``kept`` ones first (given back to it once every copy through them is
    done): pinning a fresh 64 MiB buffer costs more than the copy through it."""
    import torch

    stages = [kept.pop() for _ in range(min(want, len(kept)))]
    return stages + [torch.empty(STAGE, dtype=torch.uint8, pin_memory=True) for _ in range(want - len(stages))]


class _StagedReads:
    """Reader threads filling pinned staging buffers with ``chunks`` of one file, in any order; ``take(j)``
    hands chunk j's buffer once read, ``give_back(i)`` returns a buffer for the next chunk."""

    def __init__(self, path: Path, offset: int, chunks: list[tuple[int, int]], stages: list, follow: bool,
                 workers: int) -> None:
        self.path, self.offset, self.chunks, self.stages, self.follow = path, offset, chunks, stages, follow
        self.free: queue.Queue = queue.Queue()
        for i in range(len(stages)):
            self.free.put(i)
        self.ready: dict[int, int] = {}
        self.cond = threading.Condition()
        self.todo, self.todo_lock = iter(range(len(chunks))), threading.Lock()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._read, daemon=True) for _ in range(workers)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            while True:
                with self.todo_lock:
                    j = next(self.todo, None)
                if j is None:
                    return
                s = self.free.get()
                a, n = self.chunks[j]
                _pread_into(self.path, self.offset + a, tensor_bytes_view(self.stages[s])[:n], self.follow)
                with self.cond:
                    self.ready[j] = s
                    self.cond.notify_all()
        except BaseException as e:  # re-raised by join
            self.errors.append(e)
            with self.cond:
                self.cond.notify_all()

    def take(self, j: int) -> int | None:
        """The staging buffer holding chunk j, waiting for it; None once a reader failed."""
        with self.cond:
            while j not in self.ready and not self.errors:
                self.cond.wait()
            return None if self.errors else self.ready.pop(j)

    def give_back(self, i: int) -> None:
        self.free.put(i)

    def join(self) -> None:
        for t in self.threads:
            t.join()
        if self.errors:
            raise self.errors[0]


def _read_to_device(path: Path, offset: int, nbytes: int, device: torch.device, follow: bool, kept: list) -> torch.Tensor:
    import torch

    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _stream_to_device(path, offset, nbytes, device, follow, kept,
                      lambda a, n, stage: dst[a:a + n].copy_(stage[:n], non_blocking=True))
    return dst


def _stream_to_device(path: Path, offset: int, nbytes: int, device: torch.device, follow: bool, kept: list,
                      sink) -> None:
    """The file's bytes [offset, offset + nbytes) through pinned staging buffers, in order: ``sink(a, n, stage)``
    enqueues asynchronous copies of the span's bytes [a, a + n) out of ``stage`` on the current stream."""
    import torch

    if nbytes == 0:
        return
    chunks = [(a, min(STAGE, nbytes - a)) for a in range(0, nbytes, STAGE)]
    workers = max(1, min(4, len(chunks), (os.cpu_count() or 1) // 2))
    stages = _take_stages(kept, min(len(chunks), 2 * workers))
    reads = _StagedReads(path, offset, chunks, stages, follow, workers)
    stream = torch.cuda.current_stream(device)
    for j, (a, n) in enumerate(chunks):
        s = reads.take(j)
        if s is None:
            break
        sink(a, n, stages[s])
        ev = torch.cuda.Event()
        ev.record(stream)
        # recycle the staging buffer once its copy is done, without blocking this loop on it
        threading.Thread(target=lambda e=ev, i=s: (e.synchronize(), reads.give_back(i)), daemon=True).start()
    reads.join()
    stream.synchronize()
    kept.extend(stages)
