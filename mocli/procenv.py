"""Process-wide settings for commands whose CPU work is many short operations (verify, convert, quantize).

Each must be made before the work starts; ``passive_omp`` before torch is imported (OpenMP reads its
environment once, when torch loads it)."""

from __future__ import annotations

import functools
import os


def passive_omp() -> None:
    """Let OpenMP's idle threads sleep instead of spinning between operations (unless the user chose).

    verify runs thousands of short tensor operations beside its hashing threads; spinning OpenMP
    workers took a core from those threads. On the 2-core build machine a verify's user time went
    from 11-14 s to 9-10 s with the workers sleeping."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def single_thread_blas() -> None:
    """One OpenBLAS thread for numpy's GEMMs (unless the user chose), set before numpy loads it.

    A conversion runs no GEMM; its numpy's BLAS threads only spun (1.3% of the CPU of an NVFP4 trtllm
    convert on the 2-core build machine, ``perf``).

    NVFP4 verify runs its GEMMs in numpy: 64 token rows each, too small to gain from BLAS threads,
    whose workers spin between calls and took the cores of the hashing and byte-check threads. On the
    2-core build machine verifying the 3.95 GiB NVFP4 bench output went from 5.08 to 4.17 s (user time
    8.8 to 6.1 s)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20


def reuse_freed_memory() -> None:
    """Keep freed blocks of up to ``MMAP_THRESHOLD`` in the heap for the next allocation, instead of
    mapping fresh pages for every block over glibc's dynamic limit (32 MiB at most, often far less)
    and giving them back when it is freed: fresh pages are faulted in and zeroed by the kernel each
    time. Freed memory up to ``TRIM_THRESHOLD`` stays with the process. Does nothing outside glibc.
    Measured on the 2-core build machine:

    - verify makes tens of tensors of a layer's size in turn (decoded weights, dequantized experts):
      its GEMM stage took 1.6-2.0 s instead of 3.2 s and its system time fell by a third;
    - convert makes one array per unit (an NVFP4 trtllm expert's gathered w13 rows: 6.3 MB): the
      3.95 GiB NVFP4 trtllm conversion made 147-151 k page faults instead of 181-199 k and took
      0.83-0.94 of the wall time in 7 pairs (0.92 of the CPU), peak RSS unchanged (0.19-0.21 GB);
    - quantize (torch's allocations): 184-187 k page faults instead of 187-194 k, wall within noise
      (0.89-0.97 in 3 of 4 pairs), peak RSS unchanged (0.41 GB)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def madvise(mm, advice: int) -> None:
    """``mm.madvise(advice)`` over the whole map, with the GIL released while the kernel works.

    CPython's ``mmap.madvise`` holds the GIL for the whole call: a thread freeing 1 GiB of touched shared
    memory (``MADV_REMOVE``, as the workers' slots are freed: 448 MiB on 16 cores) stopped the main
    thread for 0.18 s on the build VM. Through ctypes (whose foreign calls drop the GIL) the longest
    stop was 0.2 ms."""
    import ctypes

    fn = _libc_madvise()
    try:
        view = ctypes.c_char.from_buffer(mm)  # holds the map open for the call (a close raises meanwhile)
    except TypeError:  # a read-only map
        fn = None
    if fn is None:
        mm.madvise(advice)
        return
    try:
        if fn(ctypes.addressof(view), len(mm), advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        del view


@functools.cache
def _libc_madvise():
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def native(name: str):
    """The compiled module ``name`` (csrc/, built by ``pip install`` where a C compiler is found), or None
    where it was not built or ``MOCLI_NATIVE=0`` asks for the numpy passes (the same bytes): read here once
    for every caller."""
    if os.environ.get("MOCLI_NATIVE", "1") == "0":
        return None
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None
