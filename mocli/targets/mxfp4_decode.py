"""flashinfer-trtllm's MXFP4 expert layout undone (SEMANTICS §19.6), on numpy arrays or torch tensors alike:
verify and mocli's serving kernel both decode with these (the forward moves are ``mocli.plan.mxfp4_moe``'s)."""

from __future__ import annotations

from mocli.targets.decode import Array, shuffled_halves, unshuffle_rows, unswizzle


def rows(stored: Array) -> Array:
    """One expert's stored rows (weight bytes [M, cols] or a float32 bias [M]) in pre-shuffle order."""
    return unshuffle_rows(stored)


def scale_rows(stored: Array, what: str) -> Array:
    """One expert's swizzled E8M0 scales [M, Kb] -> uint8 [M, Kb] in pre-shuffle row order."""
    m, kb = stored.shape[-2:]
    return unshuffle_rows(unswizzle(stored, m, kb, what))


def pairs(fc1: Array) -> tuple[Array, Array]:
    """Pre-shuffle fc1 rows (up_i, gate_i interleaved) -> (up rows, gate rows), views."""
    return fc1[0::2], fc1[1::2]


def row_parts(stored: Array, paired: bool) -> Array:
    """``rows`` (then ``pairs`` where ``paired``) of one expert's stored weight rows [M, cols] as a view, no
    byte moved: [parts, M/32, 8, r, cols] (parts 2 and r 2 where paired: the up rows, then the gate rows;
    else 1 and 4), a part's leading dims read in order being its rows. For checks that only compare."""
    return shuffled_halves(stored, paired)
