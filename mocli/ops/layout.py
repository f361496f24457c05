"""Row orders in torch, for the FP8 paths (trtllm's shuffles of FP8 expert weights): the indices are
``mocli.ops.rows``'s; NVFP4's layouts (swizzle, shuffles, padding) are ``mocli.ops.nvfp4``'s, in numpy.

Forward transforms only; the targets pair each with an independently written inverse
(``mocli.targets.decode``) that verify uses. ``out`` buffers let the executor reuse memory
(first-touching fresh pages costs more than the copy itself).
"""

from __future__ import annotations

import numpy as np
import torch

_device_index: dict[tuple[int, str], tuple[np.ndarray, torch.Tensor]] = {}


def permute_rows(t: torch.Tensor, idx: np.ndarray | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t[idx]`` along dim 0 (None = unchanged), into ``out`` when given. Any dtype. ``idx``: one of
    ``mocli.ops.rows``'s cached indices (kept as a tensor per device for the life of the process)."""
    if idx is None:
        return t
    key = (id(idx), str(t.device))
    if key not in _device_index:
        _device_index[key] = (idx, torch.from_numpy(idx.astype(np.int64)).to(t.device))  # idx kept: its id stays its own
    idx = _device_index[key][1]
    if out is None:
        return t.index_select(0, idx)
    return torch.index_select(t, 0, idx, out=out)
