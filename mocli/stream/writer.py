"""The writer lanes: finished units written on background threads, then journalled and hashed."""

from __future__ import annotations

import os
import queue
import threading
from typing import TYPE_CHECKING

from mocli.io.safetensors_file import TensorReader
from mocli.io.shard_writer import ShardWriter
from mocli.stream.hashing import OrderedHasher
from mocli.stream.pool import BufferPool
from mocli.stream.units import Key, Piece, SourceRange, Unit

if TYPE_CHECKING:
    import torch


def writer_lanes(files: int) -> int:
    """Writer threads: one per four cores but at least two, at most one per file. Two threads copying
    into the page cache at once take 1.3 s for 3.95 GiB on a 2-core VM where one takes 3.1 s (one
    thread leaves the copy idle a third of the time), and the streaming phase of a conversion there
    dropped from 4.4-6.0 s to 3.3-3.8 s."""
    return max(1, min(files, max(2, (os.cpu_count() or 1) // 4)))


class Writer:
    """Writes finished units on background threads (pwrite, vmsplice and splice, copy_file_range: all drop the GIL).

    Output files are spread over ``lanes`` threads (``writer_lanes``), so
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
        self.pending: dict[int, list] = {}  # seq -> [lanes still writing, ends, unit, the borrowed buffers' shares]
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
        """A lane has written its part of unit ``seq``: the part goes to the hasher at once (a file is
        written by one lane, in order, so its bytes reach the hasher in order; held until the unit's other
        lanes were done too, as a unit in two files held them, the file's later units landed ahead of the
        hash and were read back from the page cache); the unit is journalled once its last lane is done,
        and its buffers go back once every part is written and hashed."""
        with self.lock:
            entry = self.pending[seq]
            entry[0] -= 1
            for i, end in ends.items():
                entry[1][i] = max(entry[1].get(i, 0), end)
            shares = entry[3]
            if not entry[0]:
                del self.pending[seq]
                if self.error is None:
                    try:
                        marks = "".join(f"\t{self.files[i]}={end}" for i, end in sorted(entry[1].items()))
                        self.journal.write(f"{entry[2].id}{marks}\n")
                        self.journal.flush()
                    except BaseException as e:
                        self.error = e
        if self.error is None and self.hasher is not None:
            try:
                self.hasher.feed(hashed, shares.release)
                return
            except BaseException as e:
                self.error = e
        shares.release()

    def put(self, unit: Unit, pieces: list[Piece], borrowed: list[torch.Tensor]) -> None:
        if self.error is not None:
            raise self.error
        n = len(self.queues)
        parts: dict[int, list[Piece]] = {}
        for p in pieces:
            parts.setdefault(self.writer.file_index[p.key] % n, []).append(p)
        self.seq += 1
        with self.lock:
            self.pending[self.seq] = [max(1, len(parts)), {}, unit, _Shares(self.pool, borrowed, max(1, len(parts)))]
        if not parts:  # nothing to write: journalled as done at once
            self._lane_done(self.seq, [], {})
        for lane, ps in parts.items():
            self.queues[lane].put((self.seq, ps))

    def __enter__(self) -> Writer:
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


class _Shares:
    """A unit's borrowed buffers, one share per lane writing it: back to the pool with the last share
    (each lane's once its part is hashed)."""

    def __init__(self, pool: BufferPool, borrowed: list, shares: int) -> None:
        self.pool, self.borrowed, self.left, self.lock = pool, borrowed, shares, threading.Lock()

    def release(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.pool.give(self.borrowed)
