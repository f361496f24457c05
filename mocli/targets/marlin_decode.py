"""The marlin layout's inverses: what verify and the serving emulation decode a Marlin module with.

Written from SEMANTICS §13.5's description of the layout (which code sits in which nibble of which
word, the scale permutations, the E5M3 form), without ``mocli.ops.marlin``'s code; tests hold them to
``tests/reference.py``'s restatement of vLLM's python reference (the perm list of ``get_weight_perm(4)``,
16x16 tiles), so neither a wrong forward nor a wrong inverse of ours can pass by cancelling the other.
The weight's inverse and the block scales' read-back run in C where ``pip install`` built them
(csrc/marlin_decode.c, written apart from the repack's C as well; ``NATIVE``; ``MOCLI_NATIVE=0`` keeps
numpy: the same bytes).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

from mocli import workers as wk
from mocli.numerics import FP8_MAX
from mocli.numerics.lookup import byte_lookup
from mocli.procenv import native
from mocli.targets.decode import LayoutError

_c = native("mocli.targets._marlin_decode")
NATIVE = _c is not None  # the weight's inverse and the block scales' read-back in C

# 64-row groups decoded at a time: about this many bytes, so the passes run in the core's cache
BLOCK_BYTES = 1 << 19
_SLAB = 64  # columns of words transposed at a time (``transposed``)
# Threads one decode uses in process: one per eight cores, up to four. verify decodes in its worker
# processes (``mocli.workers``, one thread each), so these serve only where the workers are off
# (MOCLI_KERNEL_PROCS=0) and in serving's CPU kernels (``mocli.serve``)
DECODE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 8))


def decode_weight(stored: np.ndarray, n: int, k: int, what: str) -> np.ndarray:
    """Marlin words (bytes [Kp/16, 8 Np], or int32 [Kp/16, 2 Np]) -> the packed NVFP4 weight uint8
    [n, k/2] (low nibble first); the padding rows and columns must be zero codes.

    The layout read as SEMANTICS §13.5 has it: code (k, n) with k = 16 kt + 8h + 2b + l and
    n = 64c + 16j + 8 blk + a is nibble 4l + 2 blk + h of word (c, a, b, j) of row kt. So per block of
    64-row groups: each word's byte pairs' nibbles from (l; h) to (h; l) (one 64-bit delta swap), the
    words back to rows (c, a, b, j) with kt inside (pairs of words j = 2 jp + j2 at a time, in 64 x 64
    tiles), then each word's bytes (h, blk) to their rows' (c, j, blk, a) places."""
    raw = np.ascontiguousarray(stored).view(np.uint8)
    kt, nbytes = raw.shape
    np_, kp = nbytes // 8, 16 * kt
    pairs, out = raw.view(np.uint64), np.empty((np_, kp // 2), dtype=np.uint8)  # pairs: [kt, Np]
    groups = np_ // 64
    procs = wk.for_bytes(32 * kp * groups, 32 * kp)
    if procs is not None:  # worker processes, a slot of groups at a time (``mocli.workers``)
        procs.run_all(_tasks(pairs, out, groups))
    else:
        _decode_groups(pairs, out, groups)
    if bool(out[n:].any()) or bool(out[:n, k // 2:].any()):
        raise LayoutError(f"{what}: Marlin padding is not zero")
    return out if (n, k // 2) == out.shape else np.ascontiguousarray(out[:n, :k // 2])


def weight_matches(stored: np.ndarray, n: int, k: int, parts: list[tuple[slice, np.ndarray]]) -> bool:
    """Whether ``decode_weight(stored, n, k)`` would return ``parts`` and zeros elsewhere, decided in C without
    writing the decoded weight (verify's byte check: one pass over the stored words and the source's rows).
    A part is (the decoded rows it fills, a slice that may step; packed rows [r, k/2], each row's bytes
    contiguous). False whenever that cannot be shown: C not built, arrays not as it reads them, parts that
    overlap or pass ``n``, or a byte that differs; the caller then decodes, and decides and words it as before."""
    raw = stored.view(np.uint8) if NATIVE and stored.flags.c_contiguous and stored.ndim == 2 else None
    if raw is None or raw.shape[1] % 512 or k % 2 or not 0 < k <= 16 * raw.shape[0] or not 0 < n <= raw.shape[1] // 8:
        return False
    want = np.zeros(raw.shape[1] // 8, dtype=np.uint64)  # a row's source address; 0: zeros (padding)
    for rows, part in parts:
        got = range(n)[rows]
        at = slice(got.start, got.stop, got.step)
        view = part.view(np.uint8) if part.ndim == 2 and part.itemsize == 1 else None
        if view is None or got.step < 1 or view.shape != (len(got), k // 2) or view.strides[0] < 0 \
                or (k > 2 and view.strides[1] != 1) or bool(want[at].any()):
            return False
        want[at] = view.ctypes.data + np.arange(len(got), dtype=np.uint64) * np.uint64(view.strides[0])
    return bool(_c.matches(raw.ctypes.data, raw.strides[0], 16 * raw.shape[0], raw.shape[1] // 512, want.ctypes.data,
                           k // 2))


def _decode_groups(pairs: np.ndarray, out: np.ndarray, groups: int) -> None:
    """``decode_weight``'s blocks in this process: with ``DECODE_THREADS`` > 1 shared out to threads (blocks
    write disjoint rows), the caller taking the first share."""
    kp = 16 * pairs.shape[0]
    per = max(1, min(groups, BLOCK_BYTES // (32 * kp)))
    blocks = [(c0, min(groups, c0 + per)) for c0 in range(0, groups, per)]
    threads = 1 if wk.in_worker() else min(DECODE_THREADS, len(blocks))
    rest = [_pool().submit(_decode_blocks, pairs, out, blocks[i::threads], per) for i in range(1, threads)]
    _decode_blocks(pairs, out, blocks[0::max(threads, 1)], per)
    for f in rest:
        f.result()


def _tasks(pairs: np.ndarray, out: np.ndarray, groups: int) -> list[wk.Task]:
    """The decode as worker tasks of up to a slot's bytes: a task's word columns copied into its slot, its
    rows out of the slot into ``out``."""
    kt = pairs.shape[0]

    def task(c0: int, c1: int) -> wk.Task:
        def fill(slot: np.ndarray) -> None:
            slot.view(np.uint64).reshape(kt, 64 * (c1 - c0))[...] = pairs[:, 64 * c0:64 * c1]

        def take(slot: np.ndarray, _: bytes) -> None:
            out[64 * c0:64 * c1] = slot.reshape(64 * (c1 - c0), 8 * kt)

        n = 512 * kt * (c1 - c0)
        return wk.Task(decode_kernel, (c1 - c0,), n, n, fill, take)

    return [task(c0, c1) for c0, c1 in wk.spans(groups, 512 * kt)]


def decode_kernel(src: np.ndarray, dst: np.ndarray, args: tuple[int, ...]) -> None:
    """A worker's part (``mocli.workers``): ``src`` the words of ``g`` 64-column groups as uint64
    [Kp/16, 64 g]; ``dst`` their rows [64 g, Kp/2]."""
    (g,) = args
    kt = src.size // (512 * g)
    _decode_groups(src.view(np.uint64).reshape(kt, 64 * g), dst.reshape(64 * g, 8 * kt), g)  # one thread there


def _decode_blocks(pairs: np.ndarray, out: np.ndarray, blocks: list[tuple[int, int]], per: int) -> None:
    """``decode_weight``'s passes over the 64-row groups [c0, c1) of each block, with scratch of its own:
    the words to rows first (reading the stored bytes once), the nibbles exchanged there, in cache, then
    each byte to its place in ``out`` (9.1 -> 7.5 ms for a 3072 x 4096 weight, build VM). In C where it is
    built (``_c_decoded``: one pass)."""
    if NATIVE and _c_decoded(pairs.view(np.uint8), out, blocks):
        return
    kt = pairs.shape[0]
    byrow = np.empty((64 * per, kt), dtype=np.uint64)
    t = np.empty(byrow.size, dtype=np.uint64)
    for c0, c1 in blocks:
        cc = c1 - c0
        rows = byrow[:64 * cc]
        for i in range(0, kt, 64):
            rows[:, i:i + 64] = pairs[i:i + 64, 64 * c0:64 * c1].T
        _swap_nibbles(rows.reshape(-1), rows.reshape(-1), t[:rows.size])  # byte (l, blk) of each word: h -> l
        src = rows.view(np.uint8).reshape(cc, 8, 4, 2, kt, 2, 2, 2)  # c a b jp kt j2 h blk
        dst = out[64 * c0:64 * c1].reshape(cc, 2, 2, 2, 8, kt, 2, 4)  # c jp j2 blk a kt h b
        for h in range(2):
            for blk in range(2):
                for b in range(4):  # [c, a, jp, kt, j2] -> [c, jp, j2, a, kt]
                    dst[:, :, :, blk, :, :, h, b] = src[:, :, b, :, :, :, h, blk].transpose(0, 2, 4, 1, 3)


def _c_decoded(raw: np.ndarray, out: np.ndarray, blocks: list[tuple[int, int]]) -> bool:
    """The blocks decoded in C (csrc/marlin_decode.c) where the arrays are as it reads them (uint8, rows
    contiguous, the words' Kp/2 columns and 64 rows per group in ``out``); False where they are not."""
    ok = all(a.dtype == np.uint8 and a.ndim == 2 and a.strides[1] == 1 and a.strides[0] >= max(a.shape[1], 1)
             for a in (raw, out))
    end = max((c1 for _, c1 in blocks), default=0)
    if not ok or not out.flags.writeable or out.shape[1] != 8 * raw.shape[0] or out.shape[0] < 64 * end \
            or raw.shape[1] < 512 * end or any(not 0 <= c0 <= c1 for c0, c1 in blocks):
        return False
    for c0, c1 in blocks:
        _c.decode(raw.ctypes.data, raw.strides[0], 16 * raw.shape[0], out.ctypes.data, out.strides[0], c0, c1)
    return True


def _pool() -> ThreadPoolExecutor:
    """decode_weight's helper threads, shared by verify's threads."""
    return wk.executor("mocli-marlin-decode", 4 * max(1, DECODE_THREADS - 1))


def _swap_nibbles(words: np.ndarray, out: np.ndarray, t: np.ndarray) -> None:
    """``out`` (``words`` itself, or another array) = ``words`` (uint64, two Marlin words each) with the
    codes of each word's byte pairs regrouped: byte (l, blk) (l = 0: bytes 0-1, l = 1: bytes 2-3) holds
    codes h = 0 (low) and h = 1 (high); after, byte (h, blk) holds codes l = 0 (low) and l = 1 (high),
    NVFP4's packing, low nibble first along k. That exchanges the high nibble of byte blk with the low
    nibble of byte 2 + blk, 12 bits up: one masked delta swap of 64-bit words (``t``: scratch of ``out``'s
    shape)."""
    np.right_shift(words, _TWELVE, out=t)
    np.bitwise_xor(t, words, out=t)
    np.bitwise_and(t, _PAIR_NIBBLES, out=t)  # bits that differ between the two nibbles of each exchange
    np.bitwise_xor(words, t, out=out)
    np.left_shift(t, _TWELVE, out=t)
    np.bitwise_xor(out, t, out=out)


_PAIR_NIBBLES, _TWELVE = np.uint64(0x0000F0F00000F0F0), np.uint64(12)


@lru_cache(maxsize=1)
def _scale_slots() -> np.ndarray:
    """Where each of a run of 64 scales goes (the inverse of ``marlin_permute_scales``' 8x8 transpose
    and the [0, 2, 1, 3] swap in each 4): position of source element i + 8j among the stored 64."""
    stored_from = np.empty(64, dtype=np.int64)  # stored position p reads transposed position q = 4(p//4) + sw
    for p in range(64):
        q = 4 * (p // 4) + (0, 2, 1, 3)[p % 4]
        i, j = divmod(q, 8)
        stored_from[p] = i + 8 * j
    return np.argsort(stored_from)


@lru_cache(maxsize=64)
def _code_of_byte(sf: float) -> np.ndarray:
    """uint8 [256]: a Marlin scale byte -> the e4m3 code it was made from. The byte is bits 7..14 of the
    fp16 ``scale * sf * 2^7`` (its sign 0, the low 7 mantissa bits 0 for an e4m3 input); byte 0 is a
    flushed block (code 0)."""
    from mocli.numerics.in_numpy import e4m3_encode

    half = (np.arange(256, dtype=np.uint16) << 7).view(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore"):  # bytes 0xF8.. are fp16 Inf/NaN: never written (sf keeps scales <= 448)
        return e4m3_encode(np.minimum(half / np.float32(128) / np.float32(sf), FP8_MAX))


def decode_scales(stored: np.ndarray, n: int, kb: int, sf: float, what: str) -> np.ndarray:
    """Marlin block-scale bytes [Kp/16, Np] -> e4m3 codes uint8 [n, kb] (flushed blocks as code 0);
    padding must be zero. Transposed to rows n first, then each run of 64 rows put back in order."""
    raw = np.ascontiguousarray(stored).view(np.uint8)
    fault = f"{what}: Marlin scale padding is not zero"
    if c_takes_scales(raw, n, kb):
        return scales_in_c(raw, n, kb, _code_of_byte(sf), 0, fault)
    back = np.take(transposed(raw), _natural_rows(raw.shape[1]), axis=0)  # [Np, Kp/16]
    if bool(back[n:].any()) or bool(back[:n, kb:].any()):
        raise LayoutError(fault)
    return byte_lookup(back[:n, :kb], _code_of_byte(sf))


def c_takes_scales(raw: np.ndarray, n: int, kb: int) -> bool:
    """Whether ``scales_in_c`` is built and takes these: contiguous uint8 [rows, Np], Np a multiple of 64,
    0 < n <= Np, 0 < kb <= rows."""
    return (NATIVE and raw.dtype == np.uint8 and raw.ndim == 2 and raw.flags.c_contiguous and raw.shape[1] % 64 == 0
            and 0 < n <= raw.shape[1] and 0 < kb <= raw.shape[0])


def scales_in_c(raw: np.ndarray, n: int, kb: int, table: np.ndarray, fill: int, fault: str) -> np.ndarray:
    """Marlin's block-scale bytes back to ``table[byte]`` [n, kb] in one pass in C (csrc/marlin_decode.c),
    the padding checked to be ``fill`` there (else LayoutError(``fault``), the numpy path's words), where
    ``c_takes_scales``; the numpy passes of ``decode_scales`` write the same bytes."""
    out = np.empty((n, kb), dtype=np.uint8)
    slots, table = _slot_bytes(), np.ascontiguousarray(table, dtype=np.uint8)
    if table.shape != (256,) or not c_takes_scales(raw, n, kb) or not 0 <= fill < 256:
        raise ValueError(f"scales {raw.shape} {raw.dtype} for [{n}, {kb}], a table of {table.shape}, fill {fill}")
    if not _c.scales(raw.ctypes.data, raw.strides[0], raw.shape[0], raw.shape[1], slots.ctypes.data, table.ctypes.data,
                     out.ctypes.data, out.strides[0], n, kb, fill):
        raise LayoutError(fault)
    return out


@lru_cache(maxsize=1)
def _slot_bytes() -> np.ndarray:
    """``_scale_slots`` as the C code reads it: uint8 [64]."""
    return _scale_slots().astype(np.uint8)


def transposed(raw: np.ndarray) -> np.ndarray:
    """``raw.T`` of a contiguous uint8 [R, C] as a new contiguous array, done on words where R is a
    multiple of 4 (each four rows packed into uint32, byte r from row 4q + r; the words transposed in
    slabs): the scales' [Kp/16, Np] are, Kp being a multiple of 64. 2-3x a byte-wise transpose."""
    rows, cols = raw.shape
    if rows % 4:
        return np.ascontiguousarray(raw.T)
    packed = raw[0::4].astype(np.uint32)
    for r in (1, 2, 3):
        part = raw[r::4].astype(np.uint32)
        part <<= np.uint32(8 * r)
        packed |= part
    out = np.empty((cols, rows // 4), dtype=np.uint32)
    for i in range(0, cols, _SLAB):
        out[i:i + _SLAB] = packed[:, i:i + _SLAB].T
    return out.view(np.uint8)


@lru_cache(maxsize=16)
def _natural_rows(np_: int) -> np.ndarray:
    """The stored column of each natural n: in every run of 64, ``_scale_slots``."""
    return (np.arange(0, np_, 64).reshape(-1, 1) + _scale_slots().reshape(1, 64)).reshape(-1)


def flushed(codes: np.ndarray, sf: float) -> np.ndarray:
    """The e4m3 block-scale codes a Marlin layout holds for ``codes``: those under 2^-6 once scaled by
    ``sf`` become 0 (SEMANTICS §13.5: the kernel reads them as zero blocks)."""
    return byte_lookup(codes, _flush_table(sf))


@lru_cache(maxsize=64)
def _flush_table(sf: float) -> np.ndarray:
    """uint8 [256]: a code -> itself where its scale times ``sf`` is at least 2^-6, else 0."""
    from mocli.numerics.in_numpy import E4M3

    codes = np.arange(256, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        return np.where(E4M3 * np.float32(sf) >= np.float32(2.0**-6), codes, np.uint8(0))


def decode_bias(stored: np.ndarray, n: int, what: str) -> np.ndarray:
    """A Marlin bias [Np] (any element size, as [Np, bytes]) back to [n]: the runs of 32 un-permuted."""
    perm = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])
    back = np.empty_like(stored.reshape(-1, 32, *stored.shape[1:]))
    back[:, perm] = stored.reshape(-1, 32, *stored.shape[1:])
    back = back.reshape(stored.shape)
    if bool(back[n:].any()):
        raise LayoutError(f"{what}: Marlin bias padding is not zero")
    return back[:n]


# vLLM's exponent bias of the activation dtype minus 7: the factor the global scale was multiplied by
# (``nvfp4_marlin_process_global_scale``); read back from the manifest's ``act_dtype``
GLOBAL_SHIFT = {"bfloat16": 119, "float16": 7}


def global_of(stored: float | np.ndarray, sf: float, act_dtype: str) -> np.ndarray:
    """A stored Marlin global scale (``S2 * 2^(bias - 7) / sf``, float32) -> the source's S2: exact, both
    factors being powers of two."""
    if act_dtype not in GLOBAL_SHIFT:
        raise LayoutError(f"act_dtype {act_dtype!r} is not bfloat16 or float16")
    return (np.asarray(stored, dtype=np.float32) * np.float32(sf) / np.float32(2.0 ** GLOBAL_SHIFT[act_dtype])).astype(np.float32)


def halves(rows: np.ndarray, i: int, ip: int, what: str, w3_first: bool = False) -> np.ndarray:
    """An expert's w13 rows [2 Ip, ...] as stored for Marlin ([w1; w3], each zero-padded to Ip) -> the
    source's [w1; w3] rows [2 I, ...] (``w3_first``: [w3; w1]); the padding must be zero. Unpadded
    [w1; w3] rows come back as they are (a view), not copied."""
    if bool(rows[i:ip].any()) or bool(rows[ip + i:].any()):
        raise LayoutError(f"{what}: Marlin w13 padding rows are not zero")
    if w3_first:
        return np.concatenate([rows[ip:ip + i], rows[:i]])
    return rows[:2 * i] if i == ip else np.concatenate([rows[:i], rows[ip:ip + i]])
