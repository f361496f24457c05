"""The targets' row orders as numpy gather indices (SEMANTICS §4, §6): trtllm's shuffle_matrix_a and
the gated-activation reorder. Indices are read-only and cached; ``ops.nvfp4.permute_rows`` and
``gather_rows`` take them as they are."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mocli.ops import SHUFFLE_BLOCK


@lru_cache(maxsize=256)
def shuffle_row_indices(m: int) -> np.ndarray:
    """trtllm shuffle_matrix_a(w, 128): out[b + r] = in[b + 4*(r % 8) + r // 8], blocks of 32 rows."""
    if m % SHUFFLE_BLOCK:
        raise ValueError(f"row count {m} is not a multiple of {SHUFFLE_BLOCK}")
    r = np.arange(m)
    b, r = r - r % SHUFFLE_BLOCK, r % SHUFFLE_BLOCK
    idx = b + 4 * (r % 8) + r // 8
    idx.flags.writeable = False
    return idx


@lru_cache(maxsize=256)
def shuffle16_row_indices(m: int) -> np.ndarray:
    """trtllm shuffle_matrix_a(w, 64) (FlashInfer ``get_shuffle_matrix_a_row_indices``, epilogue tile 64:
    blocks of 16 rows): out[b + r] = in[b + 2*(r % 8) + r // 8] (SEMANTICS §18)."""
    if m % 16:
        raise ValueError(f"row count {m} is not a multiple of 16")
    r = np.arange(m)
    b, r = r - r % 16, r % 16
    idx = b + 2 * (r % 8) + r // 8
    idx.flags.writeable = False
    return idx


@lru_cache(maxsize=256)
def gated_act_row_indices(m: int) -> np.ndarray:
    """reorder_rows_for_gated_act_gemm: out[2i] = in[i], out[2i+1] = in[M/2 + i]."""
    if m % 2:
        raise ValueError(f"row count {m} is odd")
    idx = np.empty(m, dtype=np.int64)
    idx[0::2] = np.arange(m // 2)
    idx[1::2] = np.arange(m // 2, m)
    idx.flags.writeable = False
    return idx


@lru_cache(maxsize=64)
def gated_shuffled_row_indices(m: int) -> np.ndarray:
    """reorder_rows_for_gated_act_gemm, then shuffle_matrix_a: one gather index."""
    idx = gated_act_row_indices(m)[shuffle_row_indices(m)]
    idx.flags.writeable = False
    return idx
