"""What every module check is handed: the checked ranks' outputs, the source, the target layout, the
options, and where torch (FP8 kernels; FlashInfer's NVFP4 ones) runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mocli.targets import TargetLayout
from mocli.verify.results import VerifyOptions
from mocli.verify.source import SourceTensors


@dataclass
class CheckContext:
    cks: dict  # rank -> mocli.loader.ConvertedCheckpoint of each checked rank
    src: SourceTensors
    layout: TargetLayout
    opts: VerifyOptions
    tp: int
    heads: tuple[int, int] | None  # (kv heads, head dim) from the source's config.json
    rt: Any = None  # mocli.verify.common.Runtime where a check needs torch, else None
    fp4: Any = None  # mocli.verify.kinds.nvfp4_linear.Fp4Kernels where FlashInfer's NVFP4 kernels run
    pieces: Any = None  # mocli.verify.pieces.Pieces where an MoE layer's check goes to worker processes in pieces
