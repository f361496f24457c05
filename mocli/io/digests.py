"""SHA-256 of every source shard, taken in background threads from the moment the source is open.

Provenance records them so verify can tell that the source is unchanged since conversion. They are
taken off the data path: hashing starts before torch is even imported and runs beside the work
(hashlib releases the GIL). Files of a Hugging Face cache snapshot are symlinks to blobs named by
their git-lfs object id, which is the file's SHA-256: those are taken from the name (verify
re-hashes the bytes, so a damaged blob is still caught).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import threading
from pathlib import Path

_SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 8 << 20


def lfs_digest(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache symlink names, or None for an ordinary file."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    return target.name if target.parent.name == "blobs" and _SHA256_NAME.match(target.name) else None


WINDOW = 64 << 20  # bytes mapped at a time: a mapped page counts in the process's RSS until unmapped


def hash_range(h, fd: int, a: int, b: int) -> None:
    """Feed bytes [a, b) of ``fd`` to ``h`` straight from the page cache through memory maps (no
    copy into a buffer: that copy cost as much system time as the hashing on the build machines),
    one window at a time, so a multi-GB file never sits mapped in the process at once."""
    while a < b:
        start = a - a % mmap.ALLOCATIONGRANULARITY
        end = min(b, start + WINDOW)
        with mmap.mmap(fd, end - start, access=mmap.ACCESS_READ, offset=start) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                for x in range(a - start, end - start, CHUNK):
                    h.update(view[x: min(x + CHUNK, end - start)])
            finally:
                view.release()
        a = end


def sha256_file(path: Path, follow: bool = True) -> str:
    """SHA-256 of a regular file (see ``hash_range``; ``follow``: whether ``path`` may be a link)."""
    from mocli.io.paths import open_regular

    h = hashlib.sha256()
    fd = open_regular(path, follow)
    try:
        hash_range(h, fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return h.hexdigest()


class SourceDigests:
    """file name -> SHA-256 for ``files``; ``result()`` waits for the background threads."""

    def __init__(self, files: list[Path], threads: int | None = None) -> None:
        # Beside the conversion, not instead of it: one thread per four cores (one on a 2-core box).
        threads = threads or max(1, (os.cpu_count() or 1) // 4)
        self.digests: dict[str, str] = {}
        self.errors: list[OSError] = []
        todo = []
        for p in files:
            d = lfs_digest(p)
            if d:
                self.digests[p.name] = d
            else:
                todo.append(p)
        todo.sort(key=lambda p: -p.stat().st_size)
        shares: list[list[Path]] = [todo[i::threads] for i in range(threads)]
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in shares if s]
        for t in self.threads:
            t.start()

    def _run(self, files: list[Path]) -> None:
        for p in files:
            try:
                self.digests[p.name] = sha256_file(p)
            except OSError as e:
                self.errors.append(e)

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def result(self) -> dict[str, str]:
        for t in self.threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return dict(sorted(self.digests.items()))
