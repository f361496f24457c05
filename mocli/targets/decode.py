"""Inverses of the layout transforms, written independently of the forward ones in ``mocli.ops``.

Verify decodes converted bytes with these. The 128x4 interleave is undone with SEMANTICS §5's
explicit offset formula (a gather; numpy arrays by the formula's digits as a reshape) and the row
shuffles by reshapes, not by inverting the indices the converter used, so a wrong forward transform
cannot cancel itself out.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# Every function here takes and returns numpy arrays or torch tensors alike (NVFP4 verify runs in
# numpy, without torch; FP8 verify and the serving emulation in torch), through the few helpers
# below: one implementation of each inverse, whichever library holds the bytes.
Array = Any  # np.ndarray | torch.Tensor


class LayoutError(Exception):
    """Converted bytes break a layout invariant (e.g. non-zero padding)."""


def _is_np(t: Array) -> bool:
    return isinstance(t, np.ndarray)


def _contiguous(t: Array) -> Array:
    return np.ascontiguousarray(t) if _is_np(t) else t.contiguous()


def _bytes(t: Array) -> Array:
    """A contiguous-last-dim array's bytes as uint8, same memory."""
    if _is_np(t):
        return t.view(np.uint8)
    import torch

    return t.view(torch.uint8)


def _view(t: Array, kind: str) -> Array:
    """``t`` (uint8, last dim contiguous) viewed as int16/int32/int64 ``kind``, same memory."""
    if _is_np(t):
        return t.view(np.dtype(kind))
    import torch

    return t.view(getattr(torch, kind))


@lru_cache(maxsize=64)
def _word_offsets(rows: int, words: int, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """SEMANTICS §5's offset formula at k % 4 == 0, in 4-byte words (the 4 k of a word stay together);
    built once per shape."""
    m = np.repeat(np.arange(rows, dtype=np.int64), words)
    kw = np.tile(np.arange(words, dtype=np.int64), rows)
    off = ((m // 128) * (kp // 4) * 512 + kw * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4) // 4
    mask = np.ones(roundup128(rows) * kp // 4, dtype=np.bool_)
    mask[off] = False
    return off, mask


@lru_cache(maxsize=64)
def _torch_offsets(rows: int, words: int, kp: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    off, mask = _word_offsets(rows, words, kp)
    return torch.from_numpy(off).to(device), torch.from_numpy(mask).to(device)


def as_words(t: Array) -> Array:
    """``t``'s bytes as the widest integers its layout allows (int64 where each row's bytes and every
    stride are multiples of 8), same memory: comparing or copying 8 bytes per element instead of one is
    what makes a multi-GB check run at memory speed (torch.equal on uint8 ran at 1.6 GB/s on the build
    machine, on int64 at 7)."""
    if _is_np(t):
        return _np_words(t)
    raw = t.detach()
    if raw.dim() == 0:
        raw = raw.reshape(1)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    raw = _bytes(raw)  # bytes, never a float8 left as is: +0 and -0 would compare equal
    for wide in ("int64", "int32", "int16"):
        try:
            return _view(raw, wide)
        except RuntimeError:  # a row's bytes or a stride not a multiple of the width
            continue
    return raw


def _np_words(a: np.ndarray) -> np.ndarray:
    """``as_words`` for numpy, which views unaligned memory where torch refuses: the same rule made
    explicit (start, every stride and each row's bytes multiples of the width)."""
    raw = a.reshape(1) if a.ndim == 0 else a
    if raw.strides[-1] != raw.itemsize:
        raw = np.ascontiguousarray(raw)
    raw = raw.view(np.uint8)
    for wide in (8, 4, 2):
        if (raw.shape[-1] % wide == 0 and raw.__array_interface__["data"][0] % wide == 0
                and all(s % wide == 0 for s in raw.strides[:-1])):
            return raw.view(np.dtype(f"int{wide * 8}"))
    return raw


def roundup128(x: int) -> int:
    return (x + 127) // 128 * 128


def unswizzle(swizzled: Array, rows: int, cols: int, what: str) -> Array:
    """[..., Mp, Kp] 128x4-interleaved (1-byte dtype) -> uint8 [..., rows, cols], each trailing matrix
    on its own (stacked experts at once); padding must be zero."""
    lead, kp = tuple(swizzled.shape[:-2]), swizzled.shape[-1]
    if _is_np(swizzled) and swizzled.shape[-2] % 128 == 0 and kp % 4 == 0:
        return _np_unswizzle(swizzled, rows, cols, what)
    words = (cols + 3) // 4
    flat = _view(_bytes(_contiguous(swizzled)), "int32").reshape(-1, swizzled.shape[-2] * kp // 4)
    off, mask = _word_offsets(rows, words, kp) if _is_np(flat) else _torch_offsets(rows, words, kp, str(flat.device))
    if bool(flat[:, mask].any()):
        raise LayoutError(f"{what}: swizzle padding is not zero")
    out = _bytes(_contiguous(flat[:, off])).reshape(*lead, rows, words * 4)
    if bool(out[..., cols:].any()):
        raise LayoutError(f"{what}: swizzle padding is not zero")
    return out[..., :cols]


def _np_unswizzle(swizzled: np.ndarray, rows: int, cols: int, what: str) -> np.ndarray:
    """``unswizzle`` of a numpy array by the offset formula's digits instead of a gather: SEMANTICS §5
    puts element (m, k) at ((m//128, k//4, m%32, (m%128)//32) words, k%4 in the word), so the words
    read as [Mp/128, Kp/4, 32, 4] and put back in (m//128, (m%128)//32, m%32, k//4) order are the
    matrix. One strided copy of 4-byte words: 0.08 ms for a [3072, 256] expert scale against 0.28 ms
    for the gather on the build machine. The torch path keeps the gather; tests hold both to the
    reference's own offset gather."""
    *lead, mp, kp = swizzled.shape
    n = len(lead)
    words = np.ascontiguousarray(swizzled).view(np.uint8).view(np.int32).reshape(*lead, mp // 128, kp // 4, 32, 4)
    full = np.ascontiguousarray(words.transpose(*range(n), n, n + 3, n + 2, n + 1)).view(np.uint8).reshape(*lead, mp, kp)
    if bool(full[..., rows:, :].any()) or bool(full[..., :rows, cols:].any()):
        raise LayoutError(f"{what}: swizzle padding is not zero")
    return full[..., :rows, :cols]


def unpad(t: Array, rows: int, cols: int, what: str) -> Array:
    raw = _bytes(_contiguous(t)) if (t.itemsize if _is_np(t) else t.element_size()) == 1 else t
    if bool(raw[rows:].any()) or bool(raw[:, cols:].any()):
        raise LayoutError(f"{what}: padding is not zero")
    return t[:rows, :cols]


def _as(w: Array, like: Array) -> Array:
    """Words back to ``like``'s dtype and shape (``w`` contiguous, ``like``'s bytes)."""
    return _bytes(w).view(like.dtype).reshape(like.shape) if w.dtype != like.dtype else w


def unshuffle_rows(t: Array) -> Array:
    """Inverse of shuffle_matrix_a's rows: in[b + 4c + a] = out[b + 8a + c] (blocks of 32); rows are the
    second-to-last dim of a 2-D or 3-D (stacked experts) tensor; a 1-D tensor is one column."""
    if t.ndim == 1:
        return unshuffle_rows(t.reshape(-1, 1)).reshape(t.shape)
    w = as_words(t)
    return _as(_unshuffled(w).reshape(w.shape), t)


def unshuffle16_block_major(t: Array) -> Array:
    """Inverse of the FP8 block-scale experts' trtllm layout (SEMANTICS §18), one expert [K/128, M, 128] (or
    stacked [E, K/128, M, 128]) -> [M, K] ([E, M, K]): BlockMajorK undone, then the 16-row shuffle
    (in[b + 2c + a] = out[b + 8a + c])."""
    lead, (kb, m, blk) = tuple(t.shape[:-3]), t.shape[-3:]
    rows = t.swapaxes(-3, -2).reshape(*lead, m, kb * blk)  # [.., M, K] in shuffled row order
    return rows.reshape(*lead, m // 16, 2, 8, kb * blk).swapaxes(-3, -2).reshape(*lead, m, kb * blk)


def _unshuffled(t: Array) -> Array:
    """The rows of [..., M, cols] in unshuffled order as a view [..., M/32, 8, 4, cols]: row 32a + 4b + c."""
    lead, m = tuple(t.shape[:-2]), t.shape[-2]
    return t.reshape(*lead, m // 32, 4, 8, t.shape[-1]).swapaxes(-3, -2)


def shuffled_halves(t: Array, gated: bool) -> Array:
    """``unshuffle_rows`` (then ``ungate_rows`` where ``gated``) of one expert's [M, cols] rows as a view,
    no byte moved: [parts, M/32, 8, r, cols] with parts 2 and r 2 where gated (the first and the second
    half of the decoded rows), else 1 and 4. A part's leading dims read in order are its rows.
    For checks that only compare (reshaping this to [M, cols] would copy every byte)."""
    v = _unshuffled(t)
    if not gated:
        return v[None]
    # row 32a + 4b + 2c' + g of the unshuffled rows is row g * M/2 + 16a + 2b + c' once ungated:
    # [M/32, 8, 2, 2, cols] with the g axis (3) moved to the front
    a, b, _, cols = v.shape
    return v.reshape(a, b, 2, 2, cols).swapaxes(3, 2).swapaxes(2, 1).swapaxes(1, 0)


def ungate_rows(t: Array) -> Array:
    """Inverse of reorder_rows_for_gated_act_gemm: in[i] = out[2i], in[M/2 + i] = out[2i + 1] (rows as in
    ``unshuffle_rows``)."""
    if t.ndim == 1:
        return ungate_rows(t.reshape(-1, 1)).reshape(t.shape)
    lead, m = tuple(t.shape[:-2]), t.shape[-2]
    w = as_words(t)
    return _as(w.reshape(*lead, m // 2, 2, -1).swapaxes(-3, -2).reshape(w.shape), t)
