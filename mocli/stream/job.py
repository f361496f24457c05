"""Run a job: prepare or resume the partial output, run this process's units, publish.

Never prints: progress goes through callbacks, errors are typed exceptions.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mocli import devices, trace
from mocli import workers as wk
from mocli.errors import FindingsError, InputError, Interrupted, MocliError, os_error
from mocli.findings import Findings
from mocli.io.digests import DIGEST, file_digest
from mocli.io.safetensors_file import TensorReader
from mocli.io.shard_writer import (
    ShardFile,
    ShardLayout,
    ShardWriter,
    create_shards,
    finish_shards,
    shards_intact,
)
from mocli.progress import Progress
from mocli.stream.dist import Dist
from mocli.stream.hashing import OrderedHasher
from mocli.stream.journal import (
    JOURNAL_NAME,
    SOURCE_RECORD,
    journal_name,
    read_journals,
    record_source,
    recorded_source,
)
from mocli.stream.outdir import (
    OutputLock,
    check_output,
    check_partial,
    disk_usage,
    partial_dir,
    partial_hint,
    publish,
)
from mocli.stream.pool import BufferPool, UnitContext
from mocli.stream.remote import RemoteUnits
from mocli.stream.unit_runner import UNIT_WORKERS, compute_threads, ran_in_order, to_host
from mocli.stream.units import BadData, Key, Plan, Unit, check_finite
from mocli.stream.writer import Writer, writer_lanes

if TYPE_CHECKING:  # loaded only where a unit needs it (``Unit.torch_free``)
    import torch


@dataclass
class Job:
    """Everything the stream runner needs; ``finish`` writes the metadata files into the partial directory,
    given each output file's digest record (relative path -> record)."""

    command: str
    out: Path
    source_path: Path
    plan: Plan
    layouts: dict[str, ShardLayout]  # group ("" or "rank-N") -> its shards
    fingerprint: str
    finish: Callable[[Path, dict[str, str]], None]
    _: KW_ONLY  # what follows is named at every call
    overwrite: bool = False
    # as asked (auto | cpu | cuda | cuda:N), resolved when a unit needs torch (``compute_device``)
    device: str = "cpu"
    progress: Progress = field(default_factory=Progress)
    dist: Dist = field(default_factory=Dist)
    # the source's digests, taken in the background (io.digests.SourceDigests): recorded in the partial
    # once known, and compared before anything an interrupted run wrote is trusted
    source_digests: Any = None
    # the command's arguments that shape the output, by name (torchrun processes must agree on them)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobResult:
    resumed_units: int
    units: int
    files: dict[str, dict[str, str]]  # relative path -> digest record ({"xxh3_128": hex})
    bytes: int
    device: str = "cpu"  # where the units ran: the job's device, or the CPU for a plan with nothing to compute
    requested: str = "cpu"  # the job's device, resolved (auto -> cuda:0 or cpu)
    discarded_partial: int = 0  # bytes of a stale partial (other arguments) that was replaced

    def device_fields(self) -> dict[str, str]:
        """A summary's ``device``, with ``device_requested`` where the units ran elsewhere than asked."""
        return {"device": self.device} | ({"device_requested": self.requested} if self.device != self.requested else {})


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
        check_partial(partial)
        state = read_journals(partial, job.fingerprint)
        # The journal only counts if the bytes it vouches for are still there, and were made from these
        # source bytes (the fingerprint only covers the source's headers).
        intact = state is not None and all(
            shards_intact(partial / g if g else partial, lay,
                          {f.name: state[1].get(_relpath(g, f), 0) for f in lay.files})
            for g, lay in job.layouts.items()) and _same_source(job, partial, state[0])
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


def _agree_on_plan(job: Job) -> None:
    """torchrun processes started with different arguments (another -o, --tp, source) would each write
    their own plan into one directory: they compare theirs first, and all refuse (exit 2) naming the
    first difference, before anything is created."""
    dist = job.dist
    mine = {"command": job.command, "output": str(job.out.resolve()), "source": str(job.source_path.resolve()),
            **{k: str(v) for k, v in job.args.items()}, "plan": job.fingerprint}
    try:
        every = dist.gather(mine)
    except RuntimeError:  # gloo: a peer left (it failed on its own, before this point)
        raise InputError("another torchrun process stopped before the processes agreed on the plan",
                         hint="see that process's error; start every process with the same command line") from None
    for proc, other in enumerate(every):
        diff = [k for k in mine if other.get(k) != mine[k]]
        if diff:
            k = diff[0]
            what = ("the plan (source bytes or mocli version differ)" if k == "plan"
                    else f"{k} {other.get(k)!r} where process {dist.rank} has {mine[k]!r}")
            raise InputError(f"torchrun processes disagree: process {proc} has {what}",
                             hint="start every process with the same command line; nothing was written")


def _same_source(job: Job, partial: Path, done: set[str]) -> bool:
    """True when nothing is resumed, or the source digests recorded by the interrupted run equal the
    source's now (waiting for them: a resume reads the source once before it trusts the partial)."""
    if not done or job.source_digests is None:
        return True
    recorded = recorded_source(partial)
    return recorded is not None and recorded == job.source_digests.result()


def _interleave(units: list[Unit], where: dict[Key, tuple[int, int]]) -> list[Unit]:
    """The same units, each file's in the order of the file's bytes (the start of a unit's first output;
    a tensor's units, an expert or a part each, keep their plan order), and taken from all files in
    proportion to their bytes, so that the writer lanes and hashing threads of different files work at
    the same time (the plan lists them file by file, which would keep one lane busy at a time).

    File order lets the output's hash follow the writes: a unit landing past the hash position is read
    back from the page cache once the bytes before it are in. Planned expert by expert ([w13, its scales,
    w2, its scales] per expert, while the file holds all experts' w13 first), a CT-MXFP4 Marlin output
    had 1.8 of its 4.1 GiB read back, and a layer's w2 still to hash when its last w13 landed."""
    files: dict[int, list[tuple[int, Unit]]] = {}
    for u in units:
        f = where[u.outputs[0]][0] if u.outputs else -1
        start = min((s for i, s in map(where.__getitem__, u.outputs) if i == f), default=0)
        files.setdefault(f, []).append((start, u))
    ranked = []
    for f, us in files.items():
        us.sort(key=lambda su: su[0])  # stable: plan order within a tensor
        total = sum(u.input_bytes for _, u in us) or 1  # what a unit reads ~ what it writes
        done = 0
        for _, u in us:
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


# Units that can move their bytes through a GPU (``Unit.gpu``: the Marlin repack, ``mocli.ops.marlin_torch``) do
# so under --device cuda only where the CPU runs one unit at a time (``UNIT_WORKERS``: under 8 cores). On the
# 16-core H200 host the CPU path (4 unit threads, 2 repack threads each) converted the 3.95 GiB bench MoE for
# marlin in 4.8-5.0 s, the GPU path (one unit thread, torch and CUDA start-up included) in 7.5-9.4 s; the CPU
# path's repack costs ~9 s of CPU there (13.5 s user against flashinfer-cutlass's 4.6 s), which one unit
# thread would take alone.
# A second try (2026-11-28, H200): the GPU path with 4, 8 or 16 unit threads, each on a CUDA stream of its own,
# took 6.9-8.1 s against the CPU path's 5.4-6.3 s (cp 2.2 s; the same bytes): not kept. MOCLI_GPU_UNITS=1 or 0
# overrides (a tuning knob, docs/DEVELOPMENT.md).
GPU_UNITS = os.environ["MOCLI_GPU_UNITS"] == "1" if os.environ.get("MOCLI_GPU_UNITS") else UNIT_WORKERS == 1


def run(job: Job) -> JobResult:
    """Run ``job``; on failure keep a resumable partial and say where (hint), or remove it when the
    input itself is at fault (nothing to resume)."""
    # Everything alive now (torch's modules, the plan, the census) lives until the run ends: frozen, the
    # cyclic collector stops re-scanning it at every full collection (8% of a 2-core conversion's CPU).
    # torch's modules are frozen too once loaded (``compute_device``).
    gc.freeze()
    try:
        return _run(job)
    finally:
        gc.unfreeze()


def _run(job: Job) -> JobResult:
    dist = job.dist
    if dist.world > 1:
        _agree_on_plan(job)
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
        try:
            failure = _failure(e, partial, dist)  # under the lock: no other run takes the partial meanwhile
        finally:
            if lock is not None:
                lock.__exit__(None, None, None)
        raise failure from e
    if lock is not None:
        lock.__exit__(None, None, None)
    return result


def _failure(e: BaseException, partial: Path, dist: Dist) -> BaseException:
    """Say what happened to the partial output. It is kept for a resume where the run was stopped from
    outside (Ctrl-C, a full disk, another process at OUT) and dropped where the input is at fault or mocli
    itself failed (an internal error: what a bug wrote is not trusted, and a resume would meet it again).
    The partial directory is mocli's own (``_prepare`` made it, or checked its journal before resuming)."""
    if isinstance(e, BadData | FindingsError) or (isinstance(e, InputError) and getattr(e, "input_fault", False)):
        if dist.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, BadData):
            findings = Findings()
            findings.add(e.code, e.tensor, e.message, hint=e.hint)
            err = FindingsError(f"refusing to finish: {e.code} {e.tensor}: {e.message}",
                                hint=e.hint if "nothing was written" in e.hint else f"nothing was written; {e.hint}")
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
    if isinstance(e, Exception):  # an internal error (exit 3): nothing of this run is kept
        if dist.rank == 0 and partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
            e.add_note(f"nothing was kept: {partial} removed (a resume would meet the same error)")
        return e
    if hint:
        e.add_note(hint)
    return e


def _execute(job: Job, partial: Path, done: set[str], ends: dict[str, int]) -> JobResult:
    """This process's units streamed into the partial directory; then digests, and (process 0) publish."""
    dist, plan = job.dist, job.plan
    files = _files(job, partial)
    where = {(g, t.name): (i, f.offsets[t.name][0]) for i, (g, _, f) in enumerate(files) for t in f.tensors}
    keys = {k: i for k, (i, _) in where.items()}
    rel = {i: _relpath(g, f) for i, (g, _, f) in enumerate(files)}
    todo_all = [u for u in plan.units if u.id not in done]
    mine = _interleave(_share(todo_all, dist.world, dist.rank), where)
    # Buffers on loan: a unit's inputs go back as soon as it has run, so what waits for the writer is
    # outputs, about what a unit reads (FP8 quantize: half); room for every writer lane's unit and the
    # one being computed bounds memory by the largest unit.
    largest = max((u.input_bytes for u in mine), default=0)
    pool = BufferPool(limit=max(64 << 20, (writer_lanes(len(files)) + 1) * largest))
    # One process writes every file front to back, so the digests are taken as bytes go out; with
    # several processes the files are hashed once all are written.
    resumed = {i for i, r in rel.items() if r in ends}  # files an interrupted run wrote to: hashed whole at the end
    hasher = OrderedHasher(files, resumed) if dist.world == 1 else None
    if dist.world > 1:
        job.progress.start(sum(u.input_bytes for u in mine), len(mine))
    else:
        job.progress.start(sum(u.input_bytes for u in plan.units), len(plan.units))
        if done:
            job.progress.advance(sum(u.input_bytes for u in plan.units if u.id in done), len(plan.units) - len(mine))
    written: dict[Key, int] = {}
    trace.mark(f"streaming {len(mine)} units")
    error, devices_used = _stream(job, partial, mine, ShardWriter([(p, f) for _, p, f in files], keys), pool, hasher,
                                  written, rel)
    trace.mark("units written")
    error = _agree(dist, error)
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
        digests |= {rel[i]: {DIGEST: file_digest(files[i][1], follow=False)} for i in sorted(resumed)}
    else:
        digests = _hash_shared(dist, {rel[i]: path for i, (_, path, _) in enumerate(files)})
    trace.mark("output digests taken")
    if dist.rank == 0:
        _publish(job, partial, digests)
        trace.mark("published")
    dist.barrier()
    requested, ran = devices_used
    return JobResult(len(plan.units) - len(todo_all), len(plan.units), digests, sum(f.size for _, _, f in files),
                     ran, requested)


def compute_device(job: Job) -> tuple[torch.device, torch.device]:
    """(the job's device resolved, the device its units run on), importing torch: for a plan where some
    unit is not torch-free. One with nothing to compute (``Plan.compute``) runs on the CPU whatever
    was asked, where a GPU would only add pinned buffers and transfers. Same bytes."""
    import torch

    gc.freeze()  # torch's modules, now loaded, live until the run ends (see ``run``)
    asked = devices.resolve_device(job.device)
    return asked, asked if asked.type == "cpu" or job.plan.compute else torch.device("cpu")


def _stream(job: Job, partial: Path, units: list[Unit], writer: ShardWriter, pool: BufferPool,
            hasher: OrderedHasher | None, written: dict[Key, int], rel: dict[int, str],
            ) -> tuple[BaseException | None, tuple[str, str]]:
    """Run ``units`` one after another, their pieces written (and journalled) by the writer lanes, on
    the device ``compute_device`` picks; where every unit is torch-free (``Unit.torch_free``) torch is
    never imported and they run on the CPU. Returns the error that stopped it (so the other processes
    can be told before it is raised) and (device asked, device used)."""
    dist = job.dist
    threads: int | None = None
    remote: RemoteUnits | None = None
    used = ("cpu", "cpu")
    try:
        with TensorReader() as reader, open(partial / journal_name(dist.rank), "a") as journal, \
                Writer(writer, journal, pool, hasher, written, rel) as sink:
            if dist.rank and journal.tell() == 0:
                journal.write(json.dumps({"fingerprint": job.fingerprint}) + "\n")
                journal.flush()
            ctx = UnitContext(reader, None, pool)
            if not all(u.torch_free for u in units) or GPU_UNITS and any(u.gpu for u in units) and \
                    devices.requested_device(job.device).startswith("cuda"):
                trace.mark("loading torch")
                asked, ctx.device = compute_device(job)
                used = (str(asked), str(ctx.device))
                trace.mark(f"torch loaded: units run on {ctx.device}")
                pool.pin = ctx.device.type == "cuda"
                threads = compute_threads(job.plan.compute, ctx.device)
            else:
                used = (devices.requested_device(job.device), "cpu")
            recorded = job.source_digests is None or dist.rank != 0
            workers, remote = _unit_workers(job, units) if ctx.device is None else (1, None)
            trace.mark(f"{len(remote.pool.pids) if remote and remote.pool else 0} unit workers forked")
            for unit, pieces in ran_in_order(units, ctx, workers, remote):
                if not recorded and job.source_digests.done():
                    record_source(partial, job.source_digests.result())
                    recorded = True
                if ctx.device is not None and ctx.device.type == "cuda":
                    pieces = to_host(pieces, ctx)
                check_finite(pieces, job.plan.tensors)
                sink.put(unit, pieces, ctx.release(pieces))
                trace.once("first unit to the writer")
                job.progress.advance(unit.input_bytes, name=unit.id)
            if not recorded:  # publishing waits for the digests anyway
                record_source(partial, job.source_digests.result())
    except BaseException as e:  # reported after the other processes have been told
        return e, used
    finally:
        writer.close()
        if remote is not None:
            remote.close()
            trace.mark("unit workers closed")
        wk.shutdown()  # a pool forked on first use by an in-process repack too: before the lock goes
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
    return None, used


# Input bytes of in-place units (``Unit.in_place``: the Marlin repacks) from which a conversion's units go to
# worker processes on a machine of fewer than 8 cores (``mocli.workers.MANY_CORES``: there, always). On the
# 2-core VM, two workers against the units in process (alternated pairs): the 3.95 GiB NVFP4 Marlin
# conversion 0.84 of the wall time (two runs of 8; system time 2.1-2.7 s against 4.5-5.3 s), the 4.07 GiB
# CT-MXFP4 one 0.98 (6); with units whose arrays are copied into the slot and out, flashinfer-cutlass 0.97
# and -trtllm 0.96 of NVFP4, but FP8 trtllm 1.15 (6 each). A small checkpoint's units take less time than
# forking the workers.
REMOTE_MIN_BYTES = 256 << 20


def _unit_workers(job: Job, units: list[Unit]) -> tuple[int, RemoteUnits | None]:
    """How many units run at once on the CPU, and the worker processes that run them (``mocli.workers``;
    shared among a torchrun's processes): from 8 cores, or where in-place units read at least
    ``REMOTE_MIN_BYTES``. A thread per worker then waits for its unit, so that every worker has one."""
    large = sum(u.input_bytes for u in units if u.in_place) >= REMOTE_MIN_BYTES
    procs = wk.UNIT_PROCS // wk.local_world() if wk.enabled() and (wk.MANY_CORES or large) else 0
    remote = RemoteUnits(units, procs, UNIT_WORKERS) if procs >= 2 else None
    if remote is None or remote.pool is None:
        return UNIT_WORKERS, remote
    return max(UNIT_WORKERS, procs), remote


def _agree(dist: Dist, error: BaseException | None) -> BaseException | None:
    """Every process learns whether any failed: a run only publishes when all of them succeeded."""
    if dist.world == 1:
        return error
    statuses = dist.gather(None if error is None else f"{type(error).__name__}: {error}")
    failed = [s for s in statuses if s is not None]
    return error if error is not None or not failed else RuntimeError(f"another process failed: {failed[0]}")


def _hash_shared(dist: Dist, paths: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Several processes: each hashes its share of the finished files on its share of the cores
    (the hashers drop the GIL): one thread hashing 19 files took 13 of 35 s in a 38 GB torchrun convert
    on 2 GPUs. Returns every file's digest, to every process."""
    dist.barrier()
    names = sorted(paths)
    mine = names[dist.rank::dist.world]
    with ThreadPoolExecutor(max(1, min(len(mine), (os.cpu_count() or 1) // dist.world))) as ex:
        part = {n: {DIGEST: d} for n, d in zip(mine, ex.map(lambda n: file_digest(paths[n], follow=False), mine),
                                                 strict=True)}
    digests: dict[str, dict[str, str]] = {}
    for p in dist.gather(part):
        digests |= p
    return digests


def _publish(job: Job, partial: Path, digests: dict[str, str]) -> None:
    job.progress.phase("publishing")
    job.finish(partial, digests)
    publish(partial, job.out, job.overwrite)
    # Journals go only once OUT is in place: a refused publish leaves a partial a re-run resumes.
    for path in [*job.out.glob(f"{JOURNAL_NAME}*"), job.out / SOURCE_RECORD]:
        path.unlink(missing_ok=True)
