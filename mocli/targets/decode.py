"""Inverses of the layout transforms, written independently of the forward ones in ``mocli.ops``.

Verify decodes converted bytes with these. The 128x4 interleave is undone with SEMANTICS §5's
explicit offset formula (a gather) and the row shuffles by reshapes, not by inverting the
indices the converter used, so a wrong forward transform cannot cancel itself out.
"""

from __future__ import annotations

from functools import lru_cache

import torch


class LayoutError(Exception):
    """Converted bytes break a layout invariant (e.g. non-zero padding)."""


@lru_cache(maxsize=64)
def _word_offsets(rows: int, words: int, kp: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """SEMANTICS §5's offset formula at k % 4 == 0, in 4-byte words (the 4 k of a word stay together);
    built once per shape and device."""
    if device != "cpu":
        off, mask = _word_offsets(rows, words, kp)
        return off.to(device), mask.to(device)
    m = torch.arange(rows).repeat_interleave(words)
    kw = torch.arange(words).repeat(rows)
    off = ((m // 128) * (kp // 4) * 512 + kw * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4) // 4
    mask = torch.ones(roundup128(rows) * kp // 4, dtype=torch.bool)
    mask[off] = False
    return off, mask


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest integers its layout allows (int64 where each row's bytes and every
    stride are multiples of 8), same memory: comparing or copying 8 bytes per element instead of one is
    what makes a multi-GB check run at memory speed (torch.equal on uint8 ran at 1.6 GB/s on the build
    machine, on int64 at 7)."""
    raw = t.detach()
    if raw.dim() == 0:
        raw = raw.reshape(1)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    raw = raw.view(torch.uint8)  # bytes, never a float8 left as is: +0 and -0 would compare equal
    for wide in (torch.int64, torch.int32, torch.int16):
        try:
            return raw.view(wide)
        except RuntimeError:  # a row's bytes or a stride not a multiple of the width
            continue
    return raw


def roundup128(x: int) -> int:
    return (x + 127) // 128 * 128


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    """[..., Mp, Kp] 128x4-interleaved (1-byte dtype) -> uint8 [..., rows, cols], each trailing matrix
    on its own (stacked experts at once); padding must be zero."""
    lead, kp = swizzled.shape[:-2], swizzled.shape[-1]
    words = (cols + 3) // 4
    flat = swizzled.contiguous().view(torch.uint8).view(torch.int32).reshape(-1, swizzled.shape[-2] * kp // 4)
    off, mask = _word_offsets(rows, words, kp, str(flat.device))
    if bool(flat[:, mask].any()):
        raise LayoutError(f"{what}: swizzle padding is not zero")
    out = flat[:, off].view(torch.uint8).reshape(*lead, rows, words * 4)
    if bool(out[..., cols:].any()):
        raise LayoutError(f"{what}: swizzle padding is not zero")
    return out[..., :cols]


def unpad(t: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t
    if bool(raw[rows:].any()) or bool(raw[:, cols:].any()):
        raise LayoutError(f"{what}: padding is not zero")
    return t[:rows, :cols]


def _as(w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Words back to ``like``'s dtype and shape (``w`` contiguous, ``like``'s bytes)."""
    return w.view(torch.uint8).view(like.dtype).reshape(like.shape) if w.dtype != like.dtype else w


def unshuffle_rows(t: torch.Tensor) -> torch.Tensor:
    """Inverse of shuffle_matrix_a's rows: in[b + 4c + a] = out[b + 8a + c] (blocks of 32); rows are the
    second-to-last dim of a 2-D or 3-D (stacked experts) tensor; a 1-D tensor is one column."""
    if t.dim() == 1:
        return unshuffle_rows(t.reshape(-1, 1)).reshape(t.shape)
    w = as_words(t)
    return _as(_unshuffled(w).reshape(w.shape), t)


def _unshuffled(t: torch.Tensor) -> torch.Tensor:
    """The rows of [..., M, cols] in unshuffled order as a view [..., M/32, 8, 4, cols]: row 32a + 4b + c."""
    lead, m = t.shape[:-2], t.shape[-2]
    return t.reshape(*lead, m // 32, 4, 8, t.shape[-1]).transpose(-3, -2)


def shuffled_halves(t: torch.Tensor, gated: bool) -> torch.Tensor:
    """``unshuffle_rows`` (then ``ungate_rows`` where ``gated``) of one expert's [M, cols] rows as a view,
    no byte moved: [parts, M/32, 8, r, cols] with parts 2 and r 2 where gated (the first and the second
    half of the decoded rows), else 1 and 4. A part's leading dims read in order are its rows.
    For checks that only compare (reshaping this to [M, cols] would copy every byte)."""
    v = _unshuffled(t)
    if not gated:
        return v.unsqueeze(0)
    # row 32a + 4b + 2c' + g of the unshuffled rows is row g * M/2 + 16a + 2b + c' once ungated
    return v.unflatten(2, (2, 2)).movedim(3, 0)


def ungate_rows(t: torch.Tensor) -> torch.Tensor:
    """Inverse of reorder_rows_for_gated_act_gemm: in[i] = out[2i], in[M/2 + i] = out[2i + 1] (rows as in
    ``unshuffle_rows``)."""
    if t.dim() == 1:
        return ungate_rows(t.reshape(-1, 1)).reshape(t.shape)
    lead, m = t.shape[:-2], t.shape[-2]
    w = as_words(t)
    return _as(w.reshape(*lead, m // 2, 2, -1).transpose(-3, -2).reshape(w.shape), t)
