"""Work in worker processes: where a machine has cores that one Python process cannot keep busy.

Run in the threads of one process, numpy drops the GIL inside each pass but takes it back between them,
and the passes of mocli's byte moves are short (sized to stay in a core's cache): measured on a 16-core
H200 host, a Marlin conversion with 1, 4, 8 and 12 unit threads took 5.2, 4.7, 3.9 and 3.8 s, where the
same work on one core of the 2-core VM takes 7 CPU-seconds in all. Processes have a GIL each.

A kernel is a module-level function ``fn(src, dst, args) -> bytes | None`` over two uint8 arrays (a
slot's halves) and a tuple of ints: a block of the Marlin repack or of its inverse, or a whole conversion
unit (``mocli.stream.remote``), whose reply says what it wrote where. ``Workers`` forks its processes, which
all see the slots of one shared anonymous map: a calling thread takes an idle worker and a free slot, copies
the input into the slot, names the kernel and the slot over a pipe, waits for the reply (``os.read`` drops
the GIL) and copies the result out, or keeps the slot for a while (``Lease``). A task that fails in a worker
(an error, the worker gone) is the caller's to run again in process (``run`` does), where its error shows as
it would have: the bytes are the same either way.

The children ignore SIGINT (the parent decides), run numpy's BLAS on one thread, and exit when their task
pipe reaches end of file, which the parent's exit, however abrupt, brings about (each closes the other
workers' ends, so that nothing but the parent holds them). They keep the parent's other descriptors (the
readers' open files) but an output's lock (``keep_from_workers``); a stream closes its workers before it
releases that lock. A worker gone, stuck (no CPU for ``STALL`` seconds) or interrupted mid-task is killed
and not used again; a task that merely failed leaves its worker in use. They see the
parent's memory as it was when they were forked (a stream's workers are forked once its plan exists).
``MOCLI_KERNEL_PROCS`` sets how many a pool has (a tuning knob, docs/DEVELOPMENT.md; 0: none, everything in
process): by default one per core but two, at least two. Where they are used: ``MANY_CORES``.
"""

from __future__ import annotations

import gc
import mmap
import os
import queue
import signal
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mocli.procenv import madvise
from mocli.worker_loop import HEAD, REPLY, read_exact, serve

if TYPE_CHECKING:
    import numpy as np

_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # ours to use
_ASKED = os.environ.get("MOCLI_KERNEL_PROCS", "").strip()
PROCS = int(_ASKED) if _ASKED.isdigit() else max(2, _CORES - 2)  # a pool's workers (not a number: the default)
# A conversion's pool: one more on a small machine. On the 2-core VM a Marlin conversion with three took
# 0.89 of the time with two (6 alternated pairs, when a worker waited while the writer held its slot), with
# four 1.02 of three; verify (no leases) with three 1.02 of two. Half the cores on a large one: the writer
# lanes and the hashing, which a conversion waits on (the page cache takes ~4 GB/s of writes there, however
# many threads write), need cores of their own. On the 16-core H200 host (4 alternated rounds, cp 1.37 s)
# the 3.95 GiB NVFP4 MoE for marlin took 1.55 s with 8 workers, 1.66 with 14 (cores - 2) and with 5; for
# flashinfer-trtllm 1.55 s with 6 against 1.62 with 14, and 1.4 fewer CPU-seconds
UNIT_PROCS = int(_ASKED) if _ASKED.isdigit() else max(3, _CORES // 2)
# Where they are used. verify's numpy checks: on every machine (their threads' GIL cost even the 2-core VM
# time: its check of a Marlin output 5.3 s in threads, 3.9 s in two workers). Conversion units: from 8
# cores, and on any machine for a large Marlin conversion (``mocli.stream.job.REMOTE_MIN_BYTES``: units
# that make their arrays in the slot, written from there, beat one process on the 2-core VM; those copied
# out did not). The blocks of a repack or decode called in process: from 8 cores, or where
# MOCLI_KERNEL_PROCS asks
MANY_CORES = _ASKED.isdigit() or _CORES >= 8
SLOT = 8 << 20  # bytes of input (and as many of output) a kernel task may carry: a unit's output may take both
PROC_MIN = 1 << 20  # a call moving fewer bytes stays in process (forking and two copies cost more)
# bytes per task where a call can be cut: an expert's 3 MiB half in three, each to a worker of its own
TASK = int(os.environ.get("MOCLI_KERNEL_TASK_BYTES") or 0) or 1 << 20
STALL = 30  # seconds a worker may use no CPU on a task before it is given up (``_alive_until_ready``)


@dataclass
class Task:
    """One kernel call: ``fill(src)`` copies the input into the slot's first ``nin`` bytes, the kernel
    writes up to ``nout`` bytes and replies, ``take(dst, reply)`` copies them out. A kernel with no
    input may use the whole slot for its output (``nin`` 0, ``nout`` up to ``2 * SLOT``)."""

    kernel: Callable
    args: tuple[int, ...]
    nin: int
    nout: int
    fill: Callable[[np.ndarray], None] | None
    take: Callable[[np.ndarray, bytes], None]
    # the output read in place: called after ``take`` with the slot's ``Lease``, the slot free again only
    # once it is given back (``mocli.stream.remote``: a unit's pieces written from the slot); with None
    # where the pool's spare slots are leased already (copy the output now: the slot is reused)
    keep: Callable[[Lease | None], None] | None = None


class Lease:
    """A slot that its caller keeps after the task, its output still to be read there: ``give`` (once; or
    the lease's end, where an error dropped it) frees it for other tasks."""

    __slots__ = ("_give",)

    def __init__(self, give: Callable[[], None]) -> None:
        self._give: Callable[[], None] | None = give

    def give(self) -> None:
        give, self._give = self._give, None  # one holder gives it: the loan that carries it, or nobody
        if give is not None:
            give()

    __del__ = give


class Workers:
    def __init__(self, procs: int, spare: int = 0) -> None:
        """``procs`` workers and ``procs + spare`` slots, slot ``j`` worker ``j % procs``'s (a worker maps
        the pages of its own slots only: one that wrote to any slot faulted in all of them, on an H200 host
        0.9 s more system time in a Marlin conversion). A worker is idle while it has a free slot: one
        that a caller keeps (``Lease``) is one of the spares."""
        import numpy as np

        n = procs + spare
        self.arena = mmap.mmap(-1, n * 2 * SLOT)  # MAP_SHARED | MAP_ANONYMOUS: the children see every slot
        self.slots = [np.frombuffer(self.arena, dtype=np.uint8, count=2 * SLOT, offset=2 * i * SLOT)
                      for i in range(n)]
        self.pipes: list[tuple[int, int]] = []  # (task pipe's write end, reply pipe's read end)
        self.pids: list[int] = []
        self.idle: queue.SimpleQueue[int] = queue.SimpleQueue()
        # each worker's free slots, the last given back taken first (its pages are the ones in the caches)
        self.free: list[list[int]] = [list(range(i, n, procs))[::-1] for i in range(procs)]
        self.parked: set[int] = set()  # workers whose slots are all leased: idle again at a give
        self.broken: set[int] = set()
        self.leased = 0  # slots their callers keep (``Task.keep``), at most ``spare``
        self.closed = False  # its workers gone: the slots go at the last give
        self.procs, self.spare = procs, spare
        self.drivers = ThreadPoolExecutor(procs, thread_name_prefix="mocli-kernel")
        gc.freeze()  # what exists now stays out of the collector's way: the children's pages stay shared
        try:
            for i in range(procs):
                self._fork(i)
                self.idle.put(i)
        except BaseException:  # no process or descriptor left (EAGAIN, EMFILE): the ones forked go
            self.close()
            raise

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fork(self, i: int) -> None:
        global _child
        task_r, task_w = os.pipe()
        done_r, done_w = os.pipe()
        with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads: the child runs
            warnings.simplefilter("ignore", DeprecationWarning)  # only ``serve``, which takes no thread's lock
            pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                _child = True
                for fd in (task_w, done_r, *_ends, *_private):  # the parent's pipe ends, of every pool (EOF
                    os.close(fd)  # must reach them), and what no worker may hold (``keep_from_workers``)
                serve(task_r, done_w, self.slots, SLOT)
                code = 0
            finally:
                os._exit(code)
        os.close(task_r)
        os.close(done_w)
        self.pipes.append((task_w, done_r))
        _ends.update((task_w, done_r))
        self.pids.append(pid)

    def call(self, task: Task) -> bool:
        """The task in an idle worker (waiting for one); False where it failed there (run it here)."""
        if task.nin > SLOT or task.nout > (2 * SLOT if not task.nin else SLOT):
            return False
        i, s = self.idle.get(), None
        kept = False  # once True, the lease puts the slot back
        try:
            done = False
            if i not in self.broken:
                with _lock:  # an idle worker has a free slot
                    s = self.free[i].pop()
                done = self._remote(i, s, task)
            if done and task.keep is not None:
                lease = self._lease(i, s)
                kept = lease is not None
                task.keep(lease)
        finally:
            with _lock:
                if s is not None and not kept:
                    self.free[i].append(s)
                idle = i in self.broken or bool(self.free[i])  # a broken worker fails its tasks at once
                if not idle:
                    self.parked.add(i)
            if idle:
                self.idle.put(i)
        with _lock:
            STATS["done" if done else "failed"] += 1
        return done

    def _lease(self, i: int, s: int) -> Lease | None:
        """Worker ``i``'s slot ``s`` kept by its caller (the lease gives it back), or None where ``spare``
        slots are leased already (copy the output now; so at least ``procs`` slots are never leased and
        some worker always has one free): a lease lasts until the output is written and hashed. With one
        slot per worker, the units queued for the writer held the slots and their workers waited (on an
        H200 host, 14 workers: 6 at work on average; with 8 workers a Marlin conversion took 2.9 s, with a
        spare slot each 1.8-2.1 s). The slots are 16 MiB each, two per worker: 448 MiB of shared memory
        on 16 cores, in the parent's RSS as far as it touches them."""
        with _lock:
            if self.leased >= self.spare:
                return None
            self.leased += 1

        def give() -> None:
            with _lock:
                self.leased -= 1
                self.free[i].append(s)
                parked = i in self.parked
                self.parked.discard(i)
                last = self.closed and not self.leased
            if parked:
                self.idle.put(i)
            if last:  # the pool closed while this output was still being written or hashed
                self._free_slots()

        return Lease(give)

    def run(self, task: Task) -> None:
        """The task in a worker, or here where that fails."""
        if self.call(task):
            return
        import numpy as np

        src = np.empty(task.nin, dtype=np.uint8)
        if task.fill is not None:
            task.fill(src)
        dst = np.empty(task.nout, dtype=np.uint8)
        task.take(dst, task.kernel(src, dst, task.args) or b"")

    def _remote(self, i: int, s: int, task: Task) -> bool:
        """True once the worker's output is taken; False where the task failed there (the worker is fine)
        or the worker is gone or stuck (then it is killed and never used again). Anything else raised
        while a task is out (Ctrl-C) kills the worker too: its reply must never reach another task."""
        slot = self.slots[s]
        if task.fill is not None:
            task.fill(slot[:task.nin])
        name = f"{task.kernel.__module__}:{task.kernel.__qualname__}".encode()
        msg = HEAD.pack(len(name), s, task.nin, task.nout, len(task.args)) + name + \
            struct.pack(f"<{len(task.args)}q", *task.args)
        w, r = self.pipes[i]
        try:
            os.write(w, msg)  # under PIPE_BUF: whole
            head = read_exact(r, REPLY.size) if _alive_until_ready(r, self.pids[i]) else None
            ok, n = REPLY.unpack(head) if head else (0, -1)
            reply = read_exact(r, n) if ok else None
        except BaseException:
            self._give_up(i)
            if not isinstance(sys.exc_info()[1], OSError):
                raise
            return False
        if reply is None:
            if n < 0 or (ok and reply is None):  # gone, stuck, or cut off mid-reply
                self._give_up(i)
            return False
        out = slot[SLOT:SLOT + task.nout] if task.nin else slot[:task.nout]
        task.take(out, reply)
        return True

    def _give_up(self, i: int) -> None:
        self.broken.add(i)
        try:
            os.kill(self.pids[i], signal.SIGKILL)
        except OSError:
            pass

    def run_all(self, tasks: Sequence[Task]) -> None:
        """Every task, spread over the workers (the calling thread drives the first)."""
        rest = [self.drivers.submit(self.run, t) for t in tasks[1:]]
        try:
            if tasks:
                self.run(tasks[0])
        finally:
            for f in rest:
                f.result()

    def close(self) -> None:
        global _active
        with _lock:
            if _active is self:
                _active = None
        for w, r in self.pipes:  # idle workers see end of file and exit
            _ends.difference_update((w, r))
            os.close(w)
            os.close(r)
        for i, pid in enumerate(self.pids):
            try:
                if i in self.broken:  # killed, or to be: never waited on while stuck
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass
        self.pipes, self.pids = [], []
        self.drivers.shutdown(wait=False)
        with _lock:
            self.closed = True
            last = not self.leased
        if last:
            self._free_slots()

    def _free_slots(self) -> None:
        """The slots' pages given back once the pool is closed and every lease is back (a unit's pieces are
        hashed from its slot after the workers are gone), on a thread of their own. Left to the process's
        exit, they were freed on its critical path: 448 MiB of touched slots took 38-67 ms between an H200
        host's exit and its parent's wait, 0.6 ms without. ``procenv.madvise``: the other threads run meanwhile."""
        with _lock:
            slots, self.slots = self.slots, []
        if slots and hasattr(mmap, "MADV_REMOVE"):
            threading.Thread(target=madvise, args=(self.arena, mmap.MADV_REMOVE), daemon=True).start()


def _alive_until_ready(fd: int, pid: int) -> bool:
    """Wait until ``fd`` can be read; False where the worker has used no CPU for ``STALL`` seconds
    meanwhile (a worker at work uses CPU all along; one that never will is stuck on a lock the fork
    left taken). Its task then runs in process: a stuck worker costs time, never the run."""
    import select

    poll = select.poll()
    poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    last, still = None, 0  # /proc read only once a task has taken a second (1,555 reads cost 1.1 s of threads)
    while not poll.poll(1000):  # polls, not the clock: a machine paused or a job stopped is not a stall
        now = _cpu_ticks(pid)
        still = still + 1 if now == last else 0
        last = now
        if still > STALL:
            return False
    return True


def _cpu_ticks(pid: int) -> int:
    """User and system clock ticks of ``pid``; where /proc cannot say, the time (never judged stuck: a
    worker that is gone closes its pipe, which ends the wait)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return time.monotonic_ns()


_lock = threading.RLock()
_active: Workers | None = None  # the pool kernels use: a stream's, or one forked on first use
_child = False  # set in a worker: it runs everything in process
_failed = False  # a pool could not be forked: not tried again
_ends: set[int] = set()  # the parent's ends of every pool's pipes, which no child may keep open
_private: set[int] = set()  # descriptors no child may keep open (``keep_from_workers``)
STATS = {"done": 0, "failed": 0}  # tasks a worker did, and those it could not (run again in process)


_executors: dict[tuple[int, str], ThreadPoolExecutor] = {}


def executor(name: str, threads: int, in_workers: bool = False) -> ThreadPoolExecutor:
    """A thread pool by name, this process's own: a worker forked from a process whose pools had threads
    would find them gone and wait on them for ever; it gets new ones (``threads``, at most 1 there but
    ``in_workers``: for work its parent sized to the cores its workers leave idle)."""
    key = os.getpid(), name
    with _lock:
        ex = _executors.get(key)
        if ex is None:
            ex = _executors[key] = ThreadPoolExecutor(1 if _child and not in_workers else threads, thread_name_prefix=name)
        return ex


def keep_from_workers(fd: int, keep: bool = True) -> None:
    """``fd`` (an output's lock) is closed in every worker forked while it is open; ``keep`` False: no more."""
    with _lock:
        (_private.add if keep else _private.discard)(fd)


def in_worker() -> bool:
    """Whether this process is a worker (one core: the threads a call would spread over are one)."""
    return _child


def enabled() -> bool:
    """Whether this process forks workers: it is asked to (``PROCS``), can, is not a worker itself, and
    has not brought up CUDA through torch (CUDA does not support a fork after it is initialized; the
    workers would not touch it, but that case is untested and gains nothing: such a process's units run
    on the GPU or in torch)."""
    return PROCS > 0 and hasattr(os, "fork") and not _child and not _torch_cuda()


def _torch_cuda() -> bool:
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # a torch without CUDA, half imported: no CUDA to protect
        return False


def workers() -> Workers | None:
    """This process's workers for kernel tasks (forked on first use where no stream has its own); None
    where there are to be none (``PROCS``, ``MANY_CORES``), in a worker itself, or where this system cannot
    fork."""
    global _active, _failed
    procs = PROCS // local_world()
    if not enabled() or not MANY_CORES or procs < 2:
        return None
    with _lock:
        if _active is None and not _failed:
            try:
                _active = Workers(procs)
            except OSError:  # no process or descriptor to spare: in process, and not tried again
                _failed = True
        return _active


def for_bytes(total: int, group: int) -> Workers | None:
    """The workers for a call moving ``total`` bytes in groups of ``group`` bytes (a task holds at least one):
    None where it is too small to pay for the copies, a group does not fit a slot, or there are none."""
    return workers() if total >= PROC_MIN and group <= SLOT else None


def spans(groups: int, group: int) -> list[tuple[int, int]]:
    """Groups [c0, c1) for tasks of about ``TASK`` bytes (at least one group each)."""
    per = max(1, TASK // group)
    return [(c0, min(groups, c0 + per)) for c0 in range(0, groups, per)]


def local_world() -> int:
    """The processes of this run on this machine (torchrun's), among which the cores are shared."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def fresh(procs: int, spare: int = 0) -> Workers | None:
    """A pool forked now (a stream's: its children see its plan), the one kernels use until it closes;
    an earlier pool is closed first. None where no process or descriptor can be spared (then everything
    runs in process, as under 2 workers)."""
    global _active
    shutdown()
    try:
        new = Workers(procs, spare)
    except OSError:
        return None
    with _lock:
        _active = new
    return new


def shutdown() -> None:
    """Let the workers go (tests; a command's process simply exits, and they with it)."""
    with _lock:
        old = _active
    if old is not None:
        old.close()
