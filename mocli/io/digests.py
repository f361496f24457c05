"""File digests: what verify relies on to know a byte did not change.

A digest is recorded with its algorithm, ``{"xxh3_128": hex}``, ``{"blake3": hex}`` or ``{"sha256": hex}``
(a *record*; outputs written before records recorded a bare SHA-256 hex string, still read as one).

- mocli hashes what it writes, and local sources, with XXH3-128 (``DIGEST``): it detects any accidental
  change (a damaged, truncated or edited file, a source replaced after conversion) with a 2^-128 chance of
  a miss, at 14 GB/s per core on the 2-core build VM against BLAKE3's 2.5 (SHA-256's 1.3). BLAKE3 of the
  source and of every written byte was 3 of the 2-core Marlin conversion's ~6.7 CPU-seconds. What XXH3
  does not give is resistance to a forger who controls the files: ``MOCLI_DIGEST=blake3`` (or ``sha256``)
  records a cryptographic digest instead, for the files a command writes and for its local sources.
- A source file of a Hugging Face cache snapshot is a link to a blob named by its git-lfs object id,
  which *is* the file's SHA-256: that one is recorded as is, for free, and ties the conversion to the
  file the Hub serves (verify re-hashes the bytes, so a damaged blob is still caught).
- Records of every algorithm above are read, whichever this run writes.

Source digests are taken in background threads from the moment the source is open, beside the work.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ALGORITHMS = ("xxh3_128", "blake3", "sha256")


def _chosen() -> str:
    """The algorithm of the records this process writes: ``MOCLI_DIGEST``, else XXH3-128."""
    algo = os.environ.get("MOCLI_DIGEST", "").strip().lower() or "xxh3_128"
    if algo not in ALGORITHMS:
        from mocli.errors import InputError

        raise InputError(f"MOCLI_DIGEST={algo!r} is not a digest mocli records",
                         hint=f"one of {', '.join(ALGORITHMS)}, or unset for xxh3_128")
    return algo


DIGEST = _chosen()  # what mocli takes of the files it writes and of local sources
_SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20  # bytes read and hashed at a time: fits the core's L2 cache


def new_hasher(algo: str = DIGEST, threads: bool = False):
    """An incremental hasher (``update``, ``hexdigest``); ``threads``: BLAKE3 may use every core for one
    large input (verify, where hashing is the work), not beside a conversion's own threads."""
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algo == "blake3":
        import blake3

        return blake3.blake3(max_threads=blake3.blake3.AUTO) if threads else blake3.blake3()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algo!r}")


def as_record(value: Any) -> tuple[str, str] | None:
    """(algorithm, hex) of a recorded digest: a record ``{"blake3": hex}``, or a bare SHA-256 hex
    string (outputs written before records); None when it is neither."""
    if isinstance(value, str):
        return ("sha256", value) if _SHA256_NAME.match(value) else None
    if isinstance(value, dict):
        found = [(a, value[a]) for a in ALGORITHMS if isinstance(value.get(a), str)]
        return found[0] if len(found) == 1 else None
    return None


def lfs_digest(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache symlink names, or None for an ordinary file."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    return target.name if target.parent.name == "blobs" and _SHA256_NAME.match(target.name) else None


def hash_range(h, fd: int, a: int, b: int, read: bool = False) -> None:
    """Feed bytes [a, b) of ``fd`` to ``h`` straight from the page cache through memory maps, one
    window at a time, ``MAP_CHUNK`` bytes per update (see ``_hash_mapped``).

    ``read``: read into one small buffer per thread instead, which stays in the core's cache while it
    is hashed. Which costs less depends on what else the process does with the file's pages, so each
    caller takes what measured faster for it on the 2-core build machine, paired runs:
    - a conversion hashes through maps: reads took its NVFP4 trtllm convert from 3.90-4.11 s to
      3.93-4.64 s (5 pairs; the copies' system time outweighed the faster hashing);
    - verify's single-threaded hashers read: 0.98 of the wall and 0.96 of the CPU of the mapped path
      (6 pairs), with no mapped window in its RSS.
    A hasher with threads of its own (``new_hasher(threads=True)``, verify on 8+ cores) needs large
    inputs to spread, so it is always fed through maps: fed 1 MB reads, BLAKE3's threads made verify on
    the 16-core GPU machine 2.30 s with 14.9 s of CPU (1.87-2.10 s there with maps)."""
    if not read:
        _hash_mapped(h, fd, a, b)
        return
    buf = _buffer()
    view = memoryview(buf)
    while a < b:
        n = os.preadv(fd, [view[: min(CHUNK, b - a)]], a)
        if n <= 0:
            raise _ended(a)
        h.update(view[:n])
        a += n


MAP_CHUNK = 8 << 20
WINDOW = 64 << 20  # bytes mapped at a time: a mapped page counts in the process's RSS until unmapped


def _hash_mapped(h, fd: int, a: int, b: int) -> None:
    """``hash_range`` through memory maps, one window at a time, so a multi-GB file never sits mapped
    in the process at once."""
    size = os.fstat(fd).st_size
    if b > size:
        raise _ended(size)
    while a < b:
        start = a - a % mmap.ALLOCATIONGRANULARITY
        end = min(b, start + WINDOW)
        with mmap.mmap(fd, end - start, access=mmap.ACCESS_READ, offset=start) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                for x in range(a - start, end - start, MAP_CHUNK):
                    h.update(view[x: min(x + MAP_CHUNK, end - start)])
            finally:
                view.release()
        a = end


def _ended(at: int) -> OSError:
    return OSError(errno.EIO, f"unexpected end of file at byte {at} (the file shrank while it was read)")


_local = threading.local()


def _buffer() -> bytearray:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(CHUNK)
    return buf


def file_digest(path: Path, algo: str = DIGEST, follow: bool = True, threads: bool = False,
                read: bool = False) -> str:
    """Hex digest of a regular file (see ``hash_range``, whose ``read`` applies to a hasher without
    ``threads``; ``follow``: whether ``path`` may be a link)."""
    from mocli.io.paths import open_regular

    h = new_hasher(algo, threads)
    fd = open_regular(path, follow)
    try:
        hash_range(h, fd, 0, os.fstat(fd).st_size, read=read and not threads)
    finally:
        os.close(fd)
    return h.hexdigest()


def digest_or_error(path: Path, algo: str, follow: bool, threads: bool = False,
                    read: bool = False) -> tuple[str | None, str | None]:
    """(hex digest, None), or (None, why the file could not be read): for checks that report, not raise."""
    from mocli import trace
    from mocli.errors import MocliError

    try:
        return file_digest(path, algo, follow, threads, read), None
    except (OSError, MocliError) as e:
        return None, getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
    finally:
        trace.mark(f"hashed {path.name}")


class BackgroundDigests:
    """verify's digests of ``jobs`` ((path, algorithm, follow)) taken on a thread pool (the hashers drop
    the GIL; a single-threaded one reads, see ``hash_range``), one file per thread, largest first;
    ``take`` hands one job's future ((digest, None) or (None, why)) to whoever checks it. BLAKE3's own
    threads inside a file only where cores are left over for them: on 2 cores they fought verify's
    GEMM threads (13.6 s against 11.6 s)."""

    def __init__(self, jobs: list[tuple[Path, str, bool]]) -> None:
        threads = (os.cpu_count() or 1) >= 8
        def size(p: Path) -> int:
            try:
                return os.lstat(p).st_size
            except OSError:
                return 0

        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
        self.futures: dict[tuple[str, str, bool], Future] = {
            _job_key(p, a, f): self.pool.submit(digest_or_error, p, a, f, threads, read=True)
            for p, a, f in sorted(jobs, key=lambda j: -size(j[0]))}

    def take(self, path: Path, algo: str, follow: bool) -> Future | None:
        return self.futures.pop(_job_key(path, algo, follow), None)

    def shutdown(self, wait: bool = True) -> None:
        """Drop what has not started; ``wait``: for the files being hashed now."""
        self.pool.shutdown(wait=wait, cancel_futures=True)


def _job_key(path: Path, algo: str, follow: bool) -> tuple[str, str, bool]:
    return os.path.abspath(path), algo, follow


class SourceDigests:
    """file name -> digest record for ``files``; ``result()`` waits for the background threads."""

    def __init__(self, files: list[Path], threads: int | None = None) -> None:
        # Beside the conversion, not instead of it: one thread per four cores (one on a 2-core box).
        threads = threads or max(1, (os.cpu_count() or 1) // 4)
        self.digests: dict[str, dict[str, str]] = {}
        self.errors: list[OSError] = []
        todo = []
        for p in files:
            d = lfs_digest(p)
            if d:
                self.digests[p.name] = {"sha256": d}
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
                self.digests[p.name] = {DIGEST: file_digest(p)}
            except Exception as e:  # noqa: BLE001 - re-raised by result(), on the caller's thread
                self.errors.append(e)

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def result(self) -> dict[str, dict[str, str]]:
        for t in self.threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return dict(sorted(self.digests.items()))
