"""The stored schemes mocli reads: one module each, one registry.

``detect`` says which scheme a module's tensors are stored in (from dtypes and scale shapes, in
``SCHEMES`` order: the first that matches); ``by_algo`` maps a configured ``quant_algo`` to its scheme.
A new scheme is one module here plus one entry in ``SCHEMES`` (then ``mocli.kinds`` for the module
kinds it converts to, and each target that serves it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mocli.quant_config import Algo
from mocli.schemes.base import Merge, ScaleSpec, Scheme, distinct
from mocli.schemes.fp8 import FP8
from mocli.schemes.fp8_block import FP8_BLOCK
from mocli.schemes.fp8_channel import FP8_CHANNEL
from mocli.schemes.mxfp4 import MXFP4
from mocli.schemes.mxfp8 import MXFP8
from mocli.schemes.nvfp4 import NVFP4, NVFP4_AWQ, W4A16_NVFP4
from mocli.schemes.spelling import COMPRESSED_TENSORS, MODELOPT, Spelling

if TYPE_CHECKING:
    from mocli.io.safetensors_file import TensorEntry

# detection order: the narrower shape rules first (per-tensor, block), per channel last among FP8; MXFP4
# (U8 weight and U8 scale) before NVFP4 (U8 weight, F8_E4M3 scale); W4A16_NVFP4 is never detected, only bound
SCHEMES: tuple[Scheme, ...] = (MXFP4, NVFP4, MXFP8, FP8, FP8_BLOCK, FP8_CHANNEL, W4A16_NVFP4, NVFP4_AWQ)
_BY_ALGO: dict[Algo, Scheme] = {s.algo: s for s in SCHEMES}


def detect(tensors: dict[str, TensorEntry]) -> Scheme | None:
    """The scheme a module is stored in (its tensors by canonical suffix); None: unquantized."""
    return next((s for s in SCHEMES if s.detect(tensors)), None)


def bind(detected: Scheme | None, configured: Algo | None) -> Scheme | None:
    """The scheme a module is in: the one its tensors show, or the configured one where that stores its
    tensors like the detected one (``Scheme.stores_like``: NVFP4 tensors configured W4A16_NVFP4)."""
    wanted = by_algo(configured)
    if detected is not None and wanted is not None and wanted.stores_like is detected.algo:
        return wanted
    return detected


def by_algo(algo: Algo | None) -> Scheme | None:
    """The stored scheme a configured ``quant_algo`` means (None: none, or MIXED_PRECISION)."""
    return _BY_ALGO.get(algo) if algo is not None else None


__all__ = ["COMPRESSED_TENSORS", "distinct", "FP8", "FP8_BLOCK", "FP8_CHANNEL", "MODELOPT", "MXFP4", "MXFP8", "NVFP4", "NVFP4_AWQ", "SCHEMES",
           "W4A16_NVFP4", "Merge", "ScaleSpec", "Scheme", "Spelling", "bind", "by_algo", "detect"]
