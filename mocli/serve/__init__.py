"""Run converted modules as they are stored: the kernels behind mocli's vLLM plugin, without vLLM.

    from mocli.serve import kernel
    k = kernel("fp8_linear", {"weight": w, "weight_scale": s, "input_scale": a}, {"n": n, "k": k}, target)
    y = k(x)                                     # [T, K] -> [T, N]; k.path says what ran
    moe = kernel("nvfp4_moe", tensors, meta, target)
    y = moe(x, topk_weights, topk_ids)           # global ids -> this rank's unreduced [T, H]

``tensors`` maps a module's roles (the manifest's ``tensors`` keys, LAYOUT.md) to tensors on the
device that should run them; ``meta`` is the manifest module's ``meta``. Which path runs where is
``mocli.serve.common``'s docstring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mocli.kinds import ModuleKind, table
from mocli.serve.common import Kernel, ServeError
from mocli.serve.dense import DenseKernel
from mocli.serve.moe import MoeKernel
from mocli.targets import layout_of

# Module kind -> its kernel class (its card's, ``mocli.kinds``)
KERNELS: dict[ModuleKind, type[Kernel]] = table("kernel")


def kernel(kind: ModuleKind | str, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], target: str,
           name: str = "") -> Kernel:
    """The kernel of one converted module (``DenseKernel`` or ``MoeKernel``), its path chosen for the
    device ``tensors`` are on."""
    return KERNELS[ModuleKind(kind)](tensors, meta, layout_of(target), name)


def kernel_of(ck, name: str, device: str | torch.device = "cpu") -> Kernel:
    """A module of a ``mocli.loader.ConvertedCheckpoint`` (one rank), its tensors moved to ``device``."""
    info = ck.module_entry(name)
    tensors = {role: ck.tensor(t, device) for role, t in info.tensors.items()}
    return kernel(info.kind, tensors, info.meta, ck.target, name)


__all__ = ["KERNELS", "DenseKernel", "Kernel", "MoeKernel", "ServeError", "kernel", "kernel_of"]
