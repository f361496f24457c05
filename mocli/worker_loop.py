"""The worker's side of ``mocli.workers``: the loop a forked child runs (``serve``), and the pipe protocol
both sides speak: a task's head (``HEAD``) with the kernel's name and its ints, a reply's head (``REPLY``)
with the kernel's reply."""

from __future__ import annotations

import importlib
import os
import signal
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

HEAD = struct.Struct("<5q")  # name length, slot, input bytes, output bytes, number of ints
REPLY = struct.Struct("<Bq")  # 1 done (0 failed), reply bytes


def serve(task_r: int, done_w: int, slots: list[np.ndarray], slot_bytes: int) -> None:
    """A child's loop: a task in, the kernel run on the slot it names, its reply out (or a failure)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    one_blas_thread()
    kernels: dict[bytes, Callable] = {}
    while True:
        head = read_exact(task_r, HEAD.size)
        if head is None:
            return
        n_name, s, nin, nout, n_args = HEAD.unpack(head)
        body = read_exact(task_r, n_name + 8 * n_args)
        if body is None:
            return
        name, args = body[:n_name], struct.unpack(f"<{n_args}q", body[n_name:])
        try:
            slot = slots[s]
            if name not in kernels:
                module, _, qual = name.decode().partition(":")
                kernels[name] = getattr(importlib.import_module(module), qual)
            dst = slot[slot_bytes:slot_bytes + nout] if nin else slot[:nout]
            reply = kernels[name](slot[:nin], dst, args) or b""
            write_all(done_w, REPLY.pack(1, len(reply)) + reply)
        except Exception:  # the parent runs it again in process, where the error shows
            write_all(done_w, REPLY.pack(0, 0))


def one_blas_thread() -> None:
    """A worker is one core's worth: numpy's OpenBLAS (its GEMMs, verify's) to one thread, where it is
    loaded and says how (best effort: more threads are slower, not wrong)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.split()[-1].lower()}
    except OSError:
        return
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(1)
                break


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None at end of file (the other end is gone or done)."""
    got = b""
    while len(got) < n:
        part = os.read(fd, n - len(got))
        if not part:
            return None
        got += part
    return got
