"""Stream a plan's units into pre-planned shards: the one mechanism convert, repair and quantize share.

- Output goes to ``.<OUT>.mocli-partial`` beside OUT and is renamed into place only when complete;
  the rename refuses to replace anything this run did not create (unless ``--overwrite``).
- ``.<OUT>.mocli-lock`` (flock) keeps two runs off one OUT; the second is refused naming the first.
- A journal lists finished units; a re-run with the same plan fingerprint skips them (Ctrl-C, kill -9).
- A writer thread writes finished units while the next one computes; verbatim source bytes move
  with ``copy_file_range``; every output shard's SHA-256 is taken as its bytes complete, in order.
- Under torchrun, every process runs its share of the units and process 0 publishes.
Never prints: progress goes through callbacks, errors are typed exceptions.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mocli.errors import FindingsError, InputError, Interrupted, MocliError, os_error
from mocli.findings import Findings
from mocli.io import human_bytes
from mocli.io.digests import hash_range
from mocli.io.safetensors_file import TensorReader, tensor_bytes_view
from mocli.io.shard_writer import (
    ShardFile,
    ShardLayout,
    ShardWriter,
    create_shards,
    finish_shards,
    shards_intact,
)
from mocli.plan.core import BadData, BufferPool, Key, Piece, Plan, SourceRange, Unit, UnitContext
from mocli.progress import Progress

JOURNAL_NAME = ".mocli-journal"
HASH_CHUNK = 1 << 20  # fits in L2: reading back to hash stays cheap


# --- processes (torchrun) ---------------------------------------------------------------------------

class Dist:
    """One process. ``TorchDist`` is the torchrun version; the engine only needs these four calls."""

    world, rank = 1, 0

    def barrier(self) -> None:
        pass

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def close(self) -> None:
        pass


class TorchDist(Dist):
    """torch.distributed as torchrun starts it: gloo for the small objects the engine exchanges, and
    NCCL beside it on GPU machines (each process on its own GPU, cuda:LOCAL_RANK)."""

    def __init__(self) -> None:
        import torch.distributed as td

        self.td = td
        if not td.is_initialized():
            backend = "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
                backend = "cpu:gloo,cuda:nccl"
            td.init_process_group(backend=backend)
        self.world, self.rank = td.get_world_size(), td.get_rank()
        # objects travel over gloo whatever the default backend is
        self.group = td.new_group(backend="gloo") if torch.cuda.is_available() else None

    def barrier(self) -> None:
        self.td.barrier(group=self.group)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.td.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.td.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if self.td.is_initialized():
            self.td.destroy_process_group()


def dist_from_env() -> Dist:
    """TorchDist when started by torchrun with more than one process, else the single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return TorchDist()
    return Dist()


# --- the output directory: lock, partial, publish ----------------------------------------------------

def partial_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.mocli-partial"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.mocli-lock"


class OutputLock:
    """An exclusive flock on ``.<OUT>.mocli-lock``; released (and the file removed) on exit.

    The holder writes who it is into the file, so a second run can name it. flock is released by
    the kernel when a process dies, so kill -9 never leaves a stale lock.
    """

    def __init__(self, out: Path, command: str) -> None:
        self.path, self.command, self.fd = lock_path(out), command, -1
        self.out = out

    def __enter__(self) -> OutputLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                raise InputError(f"{self.out}: another mocli run is writing it ({holder})",
                                 hint="wait for it to finish or stop it; running the same command afterwards "
                                      "resumes its work") from None
            # The holder before us may have removed the file after we opened it: lock the live one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        info = f"pid {os.getpid()} on {socket.gethostname()}, {self.command}, since {time.strftime('%H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)


def check_output(out: Path, overwrite: bool, source: Path) -> None:
    out_r, src_r = out.resolve(), source.resolve()
    if out_r == src_r or out_r.is_relative_to(src_r) or src_r.is_relative_to(out_r):
        raise InputError(f"{out}: output overlaps the input checkpoint", hint="choose a directory elsewhere")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise InputError(f"{out}: exists and is not a directory", hint="choose another output path")
        if any(out.iterdir()) and not overwrite:
            raise InputError(f"{out}: directory is not empty", hint="pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise InputError(f"{out.parent}: parent directory does not exist", hint="create it first")


def disk_usage(path: Path) -> int:
    """Bytes allocated under ``path`` (sparse files count what they hold)."""
    total = 0
    for p in [path, *path.rglob("*")]:
        try:
            total += p.lstat().st_blocks * 512
        except OSError:
            pass
    return total


def partial_hint(partial: Path) -> str:
    return (f"partial output kept in {partial} ({human_bytes(disk_usage(partial), digits=1)}); run the same command again "
            "to resume, or delete that directory")


def publish(partial: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished partial directory to OUT without clobbering what this run did not make.

    rename(2) replaces an empty directory atomically and fails on a non-empty one, so a directory
    that appeared at OUT during the run (with files in it) is refused even without a check race.
    """
    if overwrite and out.is_dir() and any(out.iterdir()):
        old = out.parent / f".{out.name}.mocli-old-{os.getpid()}"
        os.rename(out, old)
        os.rename(partial, out)
        shutil.rmtree(old)
        return
    try:
        os.rename(partial, out)
    except OSError as e:
        if e.errno in (39, 20, 21):  # ENOTEMPTY, ENOTDIR, EISDIR: something else is at OUT now
            raise InputError(f"{out}: appeared while mocli ran and is not an empty directory; nothing was "
                             "replaced", hint=partial_hint(partial) + " (use --overwrite or another -o)") from None
        raise


# --- journal -------------------------------------------------------------------------------------------

def _journal_name(proc: int) -> str:
    return JOURNAL_NAME if proc == 0 else f"{JOURNAL_NAME}.{proc}"


def read_journals(partial: Path, fingerprint: str) -> tuple[set[str], dict[str, int]] | None:
    """Units finished by any process of an earlier run with this fingerprint, and per output file
    (relative path) the bytes those units had written (None: not resumable)."""
    done: set[str] = set()
    ends: dict[str, int] = {}
    found = False
    for path in sorted(partial.glob(f"{JOURNAL_NAME}*")):
        try:
            lines = path.read_text().splitlines()
            head = json.loads(lines[0]) if lines else {}
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if not isinstance(head, dict) or head.get("fingerprint") != fingerprint:
            return None
        found = True
        for line in lines[1:]:
            unit, _, marks = line.partition("\t")
            done.add(unit)
            for mark in filter(None, marks.split("\t")):
                rel, _, end = mark.rpartition("=")
                ends[rel] = max(ends.get(rel, 0), int(end))
    return (done, ends) if found else None


# --- output digests, taken in file order as bytes complete ----------------------------------------------

class OrderedHasher:
    """SHA-256 of every output file, fed as the writer appends: bytes still in memory are hashed
    from there (no read-back), ranges copied file to file or landing ahead of the hash position are
    read back (through a memory map: no copy) once the bytes before them are in. Files are spread
    over ``threads`` hashing threads (hashlib drops the GIL), one per four cores; each unit's pooled
    buffers go back to the pool when every thread is done with them."""

    def __init__(self, files: list[tuple[str, Path, ShardFile]], pool: BufferPool, resumed: dict[int, int],
                 threads: int | None = None) -> None:
        self.files, self.pool = files, pool
        self.sha = [hashlib.sha256() for _ in files]
        self.pos = [0] * len(files)
        self.ahead: list[dict[int, int]] = [{} for _ in files]  # start -> end, written but not hashed yet
        self.error: BaseException | None = None
        self.fds: dict[int, int] = {}
        self.fd_lock = threading.Lock()
        self.pending: dict[int, list] = {}  # feed id -> [threads still holding it, borrowed buffers]
        self.pending_lock = threading.Lock()
        self.fed = 0
        for i, (_, _, f) in enumerate(files):
            if i in resumed:  # a resumed file: its finished prefix is on disk
                self.ahead[i][0] = resumed[i]
            else:
                self.sha[i].update(f.header)
                self.pos[i] = len(f.header)
        n = max(1, min(len(files), threads or (os.cpu_count() or 1) // 4))
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=2) for _ in range(n)]
        self.threads = [threading.Thread(target=self._loop, args=(q,), daemon=True) for q in self.queues]
        for t in self.threads:
            t.start()

    def feed(self, items: list[tuple[int, int, int, torch.Tensor | None]], borrowed: list) -> None:
        """(file index, offset, nbytes, the written CPU tensor or None) of one unit's writes, in order."""
        if self.error is not None:
            raise self.error
        n = len(self.queues)
        parts: dict[int, list] = {}
        for item in items:
            parts.setdefault(item[0] % n, []).append(item)
        if not parts:
            self.pool.give(borrowed)
            return
        with self.pending_lock:  # several writer lanes feed at once
            self.fed += 1
            fid = self.fed
            self.pending[fid] = [len(parts), borrowed]
        for q, part in parts.items():
            self.queues[q].put((fid, part))

    def _release(self, fid: int) -> None:
        with self.pending_lock:
            entry = self.pending[fid]
            entry[0] -= 1
            if entry[0]:
                return
            del self.pending[fid]
        self.pool.give(entry[1])

    def _fd(self, i: int) -> int:
        with self.fd_lock:
            if i not in self.fds:
                self.fds[i] = os.open(self.files[i][1], os.O_RDONLY)
            return self.fds[i]

    def _read_back(self, i: int, a: int, b: int) -> None:
        hash_range(self.sha[i], self._fd(i), a, b)

    def _drain(self, i: int) -> None:
        ahead = self.ahead[i]
        while self.pos[i] in ahead:
            end = ahead.pop(self.pos[i])
            self._read_back(i, self.pos[i], end)
            self.pos[i] = end

    def _loop(self, q: queue.Queue) -> None:
        while (item := q.get()) is not None:
            fid, items = item
            try:
                if self.error is None:
                    for i, off, n, data in items:
                        self._drain(i)
                        if off == self.pos[i] and data is not None:
                            self.sha[i].update(tensor_bytes_view(data))
                            self.pos[i] = off + n
                        else:
                            self.ahead[i][off] = max(off + n, self.ahead[i].get(off, 0))
                        self._drain(i)
            except BaseException as e:  # reported by digests()
                self.error = e
            finally:
                del items
                try:
                    self._release(fid)
                except BaseException as e:  # never leave a feeder waiting on a dead thread
                    self.error = self.error or e

    def _stop(self) -> None:
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()

    def _close_files(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        """Stop without digests (the run failed)."""
        self._stop()
        self._close_files()

    def digests(self) -> dict[int, str]:
        self._stop()
        try:
            if self.error is not None:
                raise self.error
            for i, (_, _, f) in enumerate(self.files):
                self._read_back_rest(i, f.size)
        finally:
            self._close_files()
        return {i: s.hexdigest() for i, s in enumerate(self.sha)}

    def _read_back_rest(self, i: int, size: int) -> None:
        """Whatever is left (zero-length tails, resumed prefixes never followed by writes)."""
        self._drain(i)
        if self.pos[i] < size:
            self._read_back(i, self.pos[i], size)
            self.pos[i] = size


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


# --- the writer thread -------------------------------------------------------------------------------

def writer_lanes(files: int) -> int:
    """Writer threads: one per four cores, at most one per file."""
    return max(1, min(files, (os.cpu_count() or 1) // 4))


class _Writer:
    """Writes finished units on background threads (pwrite and copy_file_range drop the GIL).

    Output files are spread over ``lanes`` threads (one per four cores, at most one per file), so
    each file is still written front to back by one thread. At most ``depth`` units wait per lane,
    which bounds memory. A unit is journalled once all its bytes are written, with how far it got
    in each file, so a resume can check those bytes are there.
    """

    def __init__(self, writer: ShardWriter, journal, pool: BufferPool, hasher: OrderedHasher | None,
                 written: dict[Key, int], files: dict[int, str], depth: int = 2, lanes: int | None = None) -> None:
        self.writer, self.journal, self.pool, self.hasher, self.written = writer, journal, pool, hasher, written
        self.files = files
        self.error: BaseException | None = None
        n = lanes or writer_lanes(len(files))
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=depth) for _ in range(n)]
        self.readers = [TensorReader() for _ in range(n)]  # source fds for copy_file_range, one set per lane
        self.threads = [threading.Thread(target=self._loop, args=(q, r), daemon=True)
                        for q, r in zip(self.queues, self.readers, strict=True)]
        self.lock = threading.Lock()  # the journal and the units in flight
        self.pending: dict[int, list] = {}  # seq -> [lanes still writing, hashed, ends, unit, borrowed]
        self.seq = 0

    def _loop(self, q: queue.Queue, sources: TensorReader) -> None:
        while (item := q.get()) is not None:
            seq, pieces = item
            hashed: list[tuple[int, int, int, torch.Tensor | None]] = []
            ends: dict[int, int] = {}
            try:
                if self.error is None:
                    for p in pieces:
                        _, start, _ = self.writer.where[p.key]
                        if isinstance(p.data, SourceRange):
                            r = p.data
                            n = self.writer.copy(p.key, p.offset, sources.fd(r.entry.file),
                                                 r.entry.start + r.start, r.nbytes)
                            view = None
                        else:
                            n, view = self.writer.write(p.key, p.offset, p.data)  # view: the bytes, kept alive
                        idx = self.writer.file_index[p.key]
                        hashed.append((idx, start + p.offset, n, view))
                        ends[idx] = max(ends.get(idx, 0), start + p.offset + n)
                        self.written[p.key] = self.written.get(p.key, 0) + n
            except BaseException as e:  # re-raised on the main thread
                self.error = e
            try:
                self._lane_done(seq, hashed, ends)
            except BaseException as e:  # never leave the main thread waiting on a dead lane
                self.error = self.error or e

    def _lane_done(self, seq: int, hashed: list, ends: dict[int, int]) -> None:
        with self.lock:
            entry = self.pending[seq]
            entry[0] -= 1
            entry[1].extend(hashed)
            for i, end in ends.items():
                entry[2][i] = max(entry[2].get(i, 0), end)
            if entry[0]:
                return
            del self.pending[seq]
            _, hashed, ends, unit, borrowed = entry
            if self.error is None:
                try:
                    marks = "".join(f"\t{self.files[i]}={end}" for i, end in sorted(ends.items()))
                    self.journal.write(f"{unit.id}{marks}\n")
                    self.journal.flush()
                except BaseException as e:
                    self.error = e
        if self.error is None and self.hasher is not None:
            try:
                self.hasher.feed(hashed, borrowed)
                return
            except BaseException as e:
                self.error = e
        self.pool.give(borrowed)

    def put(self, unit: Unit, pieces: list[Piece], borrowed: list[torch.Tensor]) -> None:
        if self.error is not None:
            raise self.error
        n = len(self.queues)
        parts: dict[int, list[Piece]] = {}
        for p in pieces:
            parts.setdefault(self.writer.file_index[p.key] % n, []).append(p)
        self.seq += 1
        with self.lock:
            self.pending[self.seq] = [max(1, len(parts)), [], {}, unit, borrowed]
        if not parts:  # nothing to write: journalled as done at once
            self._lane_done(self.seq, [], {})
        for lane, ps in parts.items():
            self.queues[lane].put((self.seq, ps))

    def __enter__(self) -> _Writer:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()
        for r in self.readers:
            r.close()
        if self.error is not None and exc[0] is None:
            raise self.error


# --- the job -----------------------------------------------------------------------------------------

@dataclass
class Job:
    """Everything the engine needs; ``finish`` writes the metadata files into the partial directory,
    given each output file's SHA-256 (relative path -> digest)."""

    command: str
    out: Path
    source_path: Path
    plan: Plan
    layouts: dict[str, ShardLayout]  # group ("" or "rank-N") -> its shards
    fingerprint: str
    finish: Callable[[Path, dict[str, str]], None]
    overwrite: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: Progress = field(default_factory=Progress)
    dist: Dist = field(default_factory=Dist)


@dataclass
class JobResult:
    resumed_units: int
    units: int
    files: dict[str, str]  # relative path -> sha256
    bytes: int
    discarded_partial: int = 0  # bytes of a stale partial (other arguments) that was replaced
    seconds: float = 0.0


def _files(job: Job, root: Path) -> list[tuple[str, Path, ShardFile]]:
    return [(g, root / g / f.name if g else root / f.name, f) for g, lay in job.layouts.items() for f in lay.files]


def _relpath(group: str, f: ShardFile) -> str:
    return f"{group}/{f.name}" if group else f.name


def _prepare(job: Job) -> tuple[set[str], dict[str, int], int]:
    """Process 0: resume from an intact partial with this fingerprint, or start a fresh one.
    Returns the finished units, the bytes they wrote per file, and the bytes of a discarded partial."""
    partial = partial_dir(job.out)
    state = None
    discarded = 0
    if partial.exists() or partial.is_symlink():
        if not partial.is_dir() or partial.is_symlink() or not any(partial.glob(f"{JOURNAL_NAME}*")):
            raise InputError(f"{partial}: exists but is not a mocli partial output",
                             hint="move or delete it; mocli does not remove what it did not create")
        state = read_journals(partial, job.fingerprint)
        # The journal only counts if the bytes it vouches for are still there.
        intact = state is not None and all(
            shards_intact(partial / g if g else partial, lay,
                          {f.name: state[1].get(_relpath(g, f), 0) for f in lay.files})
            for g, lay in job.layouts.items())
        if not intact:
            discarded = disk_usage(partial)
            shutil.rmtree(partial)  # a partial of ours from other arguments, or damaged: start over
            state = None
    if state is None:
        partial.mkdir()
        for g, lay in job.layouts.items():
            create_shards(partial / g if g else partial, lay)
        (partial / JOURNAL_NAME).write_text(json.dumps({"fingerprint": job.fingerprint}) + "\n")
        state = (set(), {})
    return state[0], state[1], discarded


def _interleave(units: list[Unit], keys: dict[Key, int]) -> list[Unit]:
    """The same units, each file's still in order, but taken from all files in proportion to their
    bytes, so that the writer lanes and hashing threads of different files work at the same time
    (the plan lists them file by file, which would keep one lane busy at a time)."""
    files: dict[int, list[Unit]] = {}
    for u in units:
        files.setdefault(keys[u.outputs[0]] if u.outputs else -1, []).append(u)
    if len(files) < 2:
        return units
    ranked = []
    for f, us in files.items():
        total = sum(u.input_bytes for u in us) or 1  # what a unit reads ~ what it writes
        done = 0
        for u in us:
            ranked.append((done / total, f, u))
            done += u.input_bytes
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [u for _, _, u in ranked]


def _share(units: list[Unit], world: int, proc: int) -> list[Unit]:
    """This process's units: greedy by input bytes, deterministic for every process."""
    if world == 1:
        return units
    load = [0] * world
    mine = []
    for u in sorted(units, key=lambda u: (-u.input_bytes, u.id)):
        p = min(range(world), key=lambda i: (load[i], i))
        load[p] += max(u.input_bytes, 1)
        if p == proc:
            mine.append(u)
    order = {u.id: i for i, u in enumerate(units)}
    return sorted(mine, key=lambda u: order[u.id])


def run(job: Job) -> JobResult:
    """Run ``job``; on failure keep a resumable partial and say where (hint), or remove it when the
    input itself is at fault (nothing to resume)."""
    t0 = time.perf_counter()
    dist = job.dist
    partial = partial_dir(job.out)
    lock = OutputLock(job.out, job.command) if dist.rank == 0 else None
    prep: Any = None
    if lock is not None:
        try:
            check_output(job.out, job.overwrite, job.source_path)
            lock.__enter__()
            try:
                prep = ("ok", *_prepare(job))
            except BaseException:
                lock.__exit__(None, None, None)
                raise
        except MocliError as e:
            if dist.world > 1:
                dist.broadcast(("error", e.message, e.hint))
            raise
        except BaseException:
            if dist.world > 1:
                dist.broadcast(("error", "process 0 failed to prepare the output", None))
            raise
    if dist.world > 1:
        prep = dist.broadcast(prep)  # process 0's decision (resume set or error) reaches everyone
    if prep[0] == "error":
        raise InputError(prep[1], hint=prep[2])
    done, ends, discarded = prep[1], prep[2], prep[3]
    try:
        result = _execute(job, partial, done, ends)
        result.discarded_partial = discarded
    except BaseException as e:
        if lock is not None:
            lock.__exit__(None, None, None)
        raise _failure(e, partial, dist) from e
    if lock is not None:
        lock.__exit__(None, None, None)
    result.seconds = time.perf_counter() - t0
    return result


def _failure(e: BaseException, partial: Path, dist: Dist) -> BaseException:
    """Say what happened to the partial output; drop it when the input is at fault."""
    if isinstance(e, BadData | FindingsError) or (isinstance(e, InputError) and getattr(e, "input_fault", False)):
        if dist.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, BadData):
            findings = Findings()
            findings.add("DAT001", e.tensor, e.message, hint="the export is broken; re-export the checkpoint")
            err = FindingsError(f"refusing to finish: DAT001 {e.tensor}: {e.message}",
                                hint="nothing was written; the export is broken, re-export it")
            err.findings = findings
            return err
        return e
    hint = partial_hint(partial) if partial.exists() else None
    if isinstance(e, KeyboardInterrupt):
        return Interrupted("interrupted", hint=hint)
    if isinstance(e, MocliError):
        if hint and partial.exists():
            e.hint = f"{e.hint}; {hint}" if e.hint else hint
        return e
    if isinstance(e, OSError):
        msg, why = os_error(e)
        return InputError(msg, hint=f"{why}; {hint}" if hint else why)
    if hint:
        e.add_note(hint)
    return e


def _execute(job: Job, partial: Path, done: set[str], ends: dict[str, int]) -> JobResult:
    dist, plan = job.dist, job.plan
    files = _files(job, partial)
    keys: dict[Key, int] = {}
    for i, (g, _, f) in enumerate(files):
        for t in f.tensors:
            keys[(g, t.name)] = i
    todo_all = [u for u in plan.units if u.id not in done]
    mine = _interleave(_share(todo_all, dist.world, dist.rank), keys)
    # Buffers on loan: a unit's inputs go back as soon as it has run, so what waits for the writer is
    # outputs, about what a unit reads (FP8 quantize: half); room for every writer lane's unit and the
    # one being computed bounds memory by the largest unit.
    largest = max((u.input_bytes for u in mine), default=0)
    pool = BufferPool(pin=job.device.type == "cuda",
                      limit=max(64 << 20, (writer_lanes(len(files)) + 1) * largest))
    # One process writes every file front to back, so the digests are taken as bytes go out; with
    # several processes the files are hashed once all are written.
    rel = {i: _relpath(g, f) for i, (g, _, f) in enumerate(files)}
    hasher = (OrderedHasher(files, pool, {i: ends[r] for i, r in rel.items() if r in ends})
              if dist.world == 1 else None)
    writer = ShardWriter([(p, f) for _, p, f in files], keys)
    total = sum(u.input_bytes for u in (mine if dist.world > 1 else plan.units))
    job.progress.start(total, len(mine) if dist.world > 1 else len(plan.units))
    if dist.world == 1 and done:
        job.progress.advance(sum(u.input_bytes for u in plan.units if u.id in done), len(plan.units) - len(mine))
    written: dict[Key, int] = {}
    error: BaseException | None = None
    threads = torch.get_num_threads()
    if job.device.type == "cpu":
        # The writer and hash threads each keep a core busy; intra-op threads beyond the rest only
        # contend with them (measured: 1 compute thread on 2 cores is 18% faster than 2).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 2))
    try:
        with TensorReader() as reader, open(partial / _journal_name(dist.rank), "a") as journal, \
                _Writer(writer, journal, pool, hasher, written, rel) as sink:
            if dist.rank and journal.tell() == 0:
                journal.write(json.dumps({"fingerprint": job.fingerprint}) + "\n")
                journal.flush()
            ctx = UnitContext(reader, job.device, pool)
            for unit in mine:
                pieces = unit.run(ctx)
                if job.device.type == "cuda":
                    pieces = _to_host(pieces, ctx)
                sink.put(unit, pieces, ctx.release(pieces))
                job.progress.advance(unit.input_bytes)
    except BaseException as e:  # reported after the other processes have been told
        error = e
    finally:
        writer.close()
        torch.set_num_threads(threads)
    if dist.world > 1:
        statuses = dist.gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [s for s in statuses if s is not None]
        if error is None and failed:
            error = RuntimeError(f"another process failed: {failed[0]}")
    if error is not None:
        if hasher is not None:
            hasher.close()
        raise error
    # Nothing left behind: every planned byte of a fresh run was written exactly once.
    if not done and dist.world == 1:
        short = [k[1] for k, t in plan.tensors.items() if written.get(k, 0) != t.nbytes]
        if short:
            raise RuntimeError(f"planned tensors not fully written: {short[:3]}")
    if dist.rank == 0:
        for g, lay in job.layouts.items():
            finish_shards(partial / g if g else partial, lay)
    if hasher is not None:
        digests = {rel[i]: d for i, d in hasher.digests().items()}
    else:
        dist.barrier()
        # this process's share of the files, on this process's share of the cores (hashlib drops the
        # GIL): one thread hashing 19 files took 13 of 35 s in a 38 GB torchrun convert on 2 GPUs
        ids = [i for i in range(len(files)) if i % dist.world == dist.rank]
        with ThreadPoolExecutor(max(1, min(len(ids), (os.cpu_count() or 1) // dist.world))) as ex:
            mine_files = dict(zip((rel[i] for i in ids), ex.map(lambda i: hash_file(files[i][1]), ids), strict=True))
        digests = {}
        for part in dist.gather(mine_files):
            digests |= part
    if dist.rank == 0:
        job.progress.phase("publishing")
        job.finish(partial, digests)
        publish(partial, job.out, job.overwrite)
        # Journals go only once OUT is in place: a refused publish leaves a partial a re-run resumes.
        for path in job.out.glob(f"{JOURNAL_NAME}*"):
            path.unlink()
    dist.barrier()
    total_bytes = sum(f.size for _, _, f in files)
    return JobResult(len(plan.units) - len(todo_all), len(plan.units), digests, total_bytes)


def _to_host(pieces: list[Piece], ctx: UnitContext) -> list[Piece]:
    """Results leave the device through pooled pinned buffers, so the writer only touches CPU memory."""
    out = []
    for p in pieces:
        if isinstance(p.data, torch.Tensor) and p.data.device.type != "cpu":
            host = ctx.buffer(tuple(p.data.shape), p.data.dtype)
            host.copy_(p.data, non_blocking=True)
            out.append(Piece(p.key, p.offset, host))
        else:
            out.append(p)
    torch.cuda.current_stream().synchronize()
    return out
