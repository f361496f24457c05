"""The output directory: the partial directory beside OUT, the lock, and the publishing rename.

- Output goes to ``.<OUT>.mocli-partial`` beside OUT and is renamed into place only when complete;
  the rename refuses to replace anything this run did not create (unless ``--overwrite``).
- ``.<OUT>.mocli-lock`` (flock) keeps two runs off one OUT; the second is refused naming the first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path

from mocli import workers as wk
from mocli.errors import InputError
from mocli.io import human_bytes


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
            try:  # never through a link: the lock file is truncated and rewritten
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno != 40:  # ELOOP: it is a link
                    raise
                raise InputError(f"{self.path}: is a symbolic link", hint="remove it; mocli's lock file is a plain "
                                 "file it creates itself") from None
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
        wk.keep_from_workers(fd)  # a worker that outlived a kill -9 of this process must not hold the lock
        info = f"pid {os.getpid()} on {socket.gethostname()}, {self.command}, since {time.strftime('%H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass
        wk.keep_from_workers(self.fd, False)
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


def check_partial(partial: Path) -> None:
    """A partial directory about to be resumed holds only what mocli writes there: regular files, and
    ``rank-N`` directories of regular files. A link (or a FIFO, device, other directory) is refused,
    naming it: resuming would write through it, outside OUT."""
    import stat

    def walk(d: Path, depth: int) -> None:
        for entry in os.scandir(d):
            path = Path(entry.path)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise InputError(f"{path}: is a symbolic link inside a partial output",
                                 hint=f"mocli never writes links there; delete {partial} to start over")
            if stat.S_ISDIR(mode) and depth == 0 and entry.name.startswith("rank-"):
                walk(path, depth + 1)
            elif not stat.S_ISREG(mode):
                raise InputError(f"{path}: is not a file mocli writes in a partial output",
                                 hint=f"delete {partial} to start over")

    walk(partial, 0)
