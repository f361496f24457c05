"""vLLM's Marlin layout of MXFP4 weights (SEMANTICS §19.5), on raw bytes in numpy.

The weight is NVFP4's Marlin repack unchanged (``mocli.ops.marlin.repack``: ``gptq_marlin_repack`` only
takes ``num_bits``), padded by the same rule (``marlin_padded_nk`` with group 32 gives the same two
candidates). The E8M0 scales take the NVFP4 scales' moves without their value rewrite: transposed to
[K/32, N], zero-padded, the 8x8 transpose in every run of 64 (``marlin_permute_scales``, group 32 < Kp)
and the [0, 2, 1, 3] swap of ``mxfp4_marlin_process_scales``; the casts between them (E8M0 -> bf16 ->
E8M0) keep every code for BF16 models, padding 0.0 becomes code 0. So the bytes move and none changes.
"""

from __future__ import annotations

import numpy as np

from mocli.ops.marlin import _scale_rows, gather_transposed, padded_nk, permute_bias, repack

GROUP = 32  # MXFP4 block size along K


def permute_scales(codes: np.ndarray, np_: int, kp: int, out: np.ndarray | None = None, fill: int = 0) -> np.ndarray:
    """E8M0 codes uint8 [N, K/32] -> Marlin's uint8 [Kp/32, Np]: padded with code ``fill`` (0; Quark's MoE
    parameters start at 1), transposed, permuted in runs of 64 along Np (the permutation moves whole rows
    before the transpose: ``_scale_rows``). ``out``: where to write it (a [Kp/32, Np] view)."""
    n, kb = codes.shape
    src = codes
    if codes.shape != (np_, kp // GROUP):
        src = np.full((np_, kp // GROUP), fill, dtype=np.uint8)
        src[:n, :kb] = codes
    res = np.empty((kp // GROUP, np_), dtype=np.uint8) if out is None else out
    return gather_transposed(src, _scale_rows(np_), res)


__all__ = ["GROUP", "padded_nk", "permute_bias", "permute_scales", "repack"]
