"""Output digests, taken in file order as the writer appends the bytes."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from mocli.io.digests import DIGEST, hash_range, new_hasher
from mocli.io.paths import open_regular
from mocli.io.safetensors_file import tensor_bytes_view
from mocli.io.shard_writer import ShardFile

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


class OrderedHasher:
    """The digest (``DIGEST``: XXH3-128 unless ``MOCLI_DIGEST`` asks) of every output file, fed as the
    writer appends: bytes still in memory are hashed from there (no read-back), ranges copied file to file
    or landing ahead of the hash position are read back (``hash_range``: through memory maps, no copy) once
    the bytes before them are in. Files are spread over ``threads`` hashing threads (the hashers drop the GIL), one per four cores; a feed is released
    (its unit's pooled buffers given back) when every thread is done with it.

    Files an earlier, interrupted run wrote to (``skip``) are not hashed here: their finished parts are
    not always a prefix (under torchrun another process may have written further in while this one's
    earlier units were lost), so the caller hashes them whole once they are complete."""

    def __init__(self, files: list[tuple[str, Path, ShardFile]], skip: set[int], threads: int | None = None) -> None:
        self.files = files
        self.sha = [new_hasher() for _ in files]
        self.pos = [0] * len(files)
        self.ahead: list[dict[int, int]] = [{} for _ in files]  # start -> end, written but not hashed yet
        self.error: BaseException | None = None
        self.fds: dict[int, int] = {}
        self.fd_lock = threading.Lock()
        self.pending: dict[int, list] = {}  # feed id -> [threads still holding it, its release]
        self.pending_lock = threading.Lock()
        self.fed = 0
        self.skip = skip
        for i, (_, _, f) in enumerate(files):
            self.sha[i].update(f.header)
            self.pos[i] = len(f.header)
        n = max(1, min(len(files), threads or (os.cpu_count() or 1) // 4))
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=2) for _ in range(n)]
        self.threads = [threading.Thread(target=self._loop, args=(q,), daemon=True) for q in self.queues]
        for t in self.threads:
            t.start()

    def feed(self, items: list[tuple[int, int, int, torch.Tensor | None]], release: Callable[[], None]) -> None:
        """(file index, offset, nbytes, the written CPU tensor or None) of one unit's writes in a lane's
        files, in order; ``release()`` once every thread is done with them."""
        if self.error is not None:
            raise self.error
        n = len(self.queues)
        parts: dict[int, list] = {}
        for item in items:
            if item[0] not in self.skip:
                parts.setdefault(item[0] % n, []).append(item)
        if not parts:
            release()
            return
        with self.pending_lock:  # several writer lanes feed at once
            self.fed += 1
            fid = self.fed
            self.pending[fid] = [len(parts), release]
        for q, part in parts.items():
            self.queues[q].put((fid, part))

    def _release(self, fid: int) -> None:
        with self.pending_lock:
            entry = self.pending[fid]
            entry[0] -= 1
            if entry[0]:
                return
            del self.pending[fid]
        entry[1]()

    def _fd(self, i: int) -> int:
        with self.fd_lock:
            if i not in self.fds:
                self.fds[i] = open_regular(self.files[i][1], follow=False)
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

    def digests(self) -> dict[int, dict[str, str]]:
        self._stop()
        try:
            if self.error is not None:
                raise self.error
            for i, (_, _, f) in enumerate(self.files):
                if i not in self.skip:
                    self._read_back_rest(i, f.size)
        finally:
            self._close_files()
        return {i: {DIGEST: s.hexdigest()} for i, s in enumerate(self.sha) if i not in self.skip}

    def _read_back_rest(self, i: int, size: int) -> None:
        """Whatever is left (zero-length tails)."""
        self._drain(i)
        if self.pos[i] < size:
            self._read_back(i, self.pos[i], size)
            self.pos[i] = size
