"""The small float32 scale tensors of a checkpoint (0-dim, per-channel, per-block), read once."""

from __future__ import annotations

import torch

from mocli.census import Census
from mocli.checkpoint import Checkpoint
from mocli.tables import SCALE_SUFFIXES


def read_scales(ckpt: Checkpoint, census: Census) -> dict[str, torch.Tensor]:
    """tensor name -> float32 CPU tensor, for every F32 scale of a quantized module and every KV scale."""
    entries = [t for m in census.modules.values() if m.scheme is not None
               for s, t in m.tensors.items() if s in SCALE_SUFFIXES and t.dtype == "F32"]
    entries += [t for t in census.kv_scales if t.dtype == "F32"]
    with ckpt.reader() as reader:
        return {t.name: reader.read(t) for t in entries}
