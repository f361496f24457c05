"""``--device`` and ``--kernels``: the choices, and the one device resolver for every command that
computes (convert, quantize, verify). No torch at import: the CLI builds its options from here."""

from __future__ import annotations

import os
from enum import StrEnum

from mocli.errors import InputError


class Device(StrEnum):
    AUTO = "auto"  # CUDA when present
    CPU = "cpu"
    CUDA = "cuda"


class Kernels(StrEnum):
    """verify's kernels: FlashInfer's where they run here (auto), torch's, or FlashInfer's only."""

    AUTO = "auto"
    TORCH = "torch"
    FLASHINFER = "flashinfer"


def resolve_device(device: str):
    """``auto`` | ``cpu`` | ``cuda`` (or ``cuda:N``) as a torch device; ``auto`` picks CUDA when present.
    Under torchrun each process takes its own GPU (LOCAL_RANK)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: no CUDA device is available", hint="use --device cpu or auto")
    if device.startswith("cuda:"):
        return torch.device(device)
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"--device {device}: not a device", hint="auto, cpu or cuda")
    return torch.device("cpu")
