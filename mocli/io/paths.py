"""Opening files we did not write, and names we read from files, without being led astray.

- ``open_regular``: a FIFO, device or directory where a file should be is an error, not a read that
  blocks forever (opened non-blocking, then checked); with ``follow=False`` a symbolic link is one too.
- ``entry_path``: a name read from a manifest or index (``rank-3/model-00001-of-00002.safetensors``)
  resolves inside its directory: relative, no ``..``, no empty or hidden parts, and no symbolic link
  on the way.

mocli's own outputs are read with ``follow=False`` (nothing in them is a link); a source checkpoint
may be a Hugging Face cache snapshot, whose files are links into ``../../blobs``.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from mocli.errors import CorruptFileError, InputError, read_error


def open_regular(path: Path, follow: bool = True, flags: int = os.O_RDONLY) -> int:
    """An fd of the regular file at ``path`` (``flags``: O_RDONLY or O_RDWR). A FIFO, socket, device or
    directory is a CorruptFileError naming it; so is a symbolic link when ``follow`` is False."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        if not follow and e.errno == 40:  # ELOOP: O_NOFOLLOW met a link
            raise not_regular(path, "a symbolic link") from None
        raise read_error(path, e) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, kind_of(mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, follow: bool = True) -> bytes:
    """The whole file at ``path`` (see ``open_regular``)."""
    fd = open_regular(path, follow)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise read_error(path, e) from None
    finally:
        os.close(fd)


def not_regular(path: Path, what: str) -> CorruptFileError:
    return CorruptFileError(f"{path}: is {what}, not a regular file",
                            hint="mocli reads only regular files there; replace it with the real file")


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def entry_path(root: Path, name: object, where: str) -> Path:
    """``root / name`` for a name read from ``where`` (a manifest or index field), refused (exit 2,
    naming the entry) unless it is a plain relative path inside ``root`` with no link on the way."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise _outside(where, name)
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise _outside(where, name)
    path = Path(root)
    for p in parts:
        path = path / p
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise InputError(f"{where}: entry {name!r} passes through a symbolic link ({path})",
                                 hint="a mocli output holds no links; restore it from the original or convert again")
        except FileNotFoundError:
            break  # missing: the caller says so in its own words
    return Path(root) / name


def _outside(where: str, name: object) -> InputError:
    return InputError(f"{where}: entry {name!r} is not a plain path inside the directory",
                      hint="names must be relative, without '..', hidden or empty parts; the file is damaged or hostile")
