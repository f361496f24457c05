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


def warm_cuda(device: str, context: bool = True) -> None:
    """Start CUDA for ``device`` on a background thread, before torch is imported: the driver, so that
    ``check_device`` can answer without torch, and (``context``) the device's primary context.

    The driver's start-up and the device's primary context (the one torch's runtime then attaches to)
    took 0.31-0.34 s at torch's first CUDA call on an H200, and 0.02 s once warmed here; importing torch
    takes about 3 s there, and the two overlap because the context is made through the driver library
    (ctypes drops the GIL while it waits). Without ``context`` (a conversion: the GPU is never used) only
    the count is taken, from /proc where it lists the GPUs (``visible_gpus``), the driver left alone. Nothing
    happens for ``cpu``, without a driver or without a device, and any failure is left for torch to
    report in its own words: this only moves work earlier."""
    if device == "cpu" or not (device == "auto" or device.startswith("cuda")) or device in _probes:
        return
    import threading

    _probes[device] = (threading.Event(), [0])
    threading.Thread(target=_warm, args=(device, context), name="mocli-cuda-warm", daemon=True).start()


_held: dict[int, int] = {}  # device index -> the primary context retained for it (tests look)
_probes: dict[str, tuple] = {}  # device -> (set once the driver has counted, [the count])


def _warm(device: str, context: bool) -> None:
    import ctypes

    counted, box = _probes[device]
    if not context and (listed := visible_gpus()) is not None:  # a count is all that is asked
        box[0] = listed
        counted.set()
        return
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count, dev, ctx = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_void_p()
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return
        box[0] = count.value
        counted.set()
        if not context:
            return
        # the device resolve_device will pick: cuda:N, else this process's LOCAL_RANK
        index = int(device.split(":", 1)[1]) if ":" in device else int(os.environ.get("LOCAL_RANK", "0")) % count.value
        if cuda.cuDeviceGet(ctypes.byref(dev), index) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:
            _held[index] = ctx.value  # held for the life of the process
    except (OSError, ValueError, AttributeError):
        return
    finally:
        counted.set()


PROC_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA kernel driver drives


def visible_gpus() -> int | None:
    """The CUDA devices this process would see, without starting the CUDA driver: the NVIDIA kernel
    driver's GPUs (``PROC_GPUS``) as ``CUDA_VISIBLE_DEVICES`` narrows them (an empty list hides all; the
    list ends at an index out of range, as CUDA reads it; a GPU-/MIG- UUID counts as one); None where
    /proc does not list them (the driver is asked instead). Starting the driver (cuInit) only to count,
    for a conversion that never uses the GPU, cost an H200 host 40 ms of its start-up and 50-60 ms of
    its exit (5 alternated pairs of --device cuda and cpu)."""
    try:
        gpus = len(os.listdir(PROC_GPUS))
    except OSError:
        return None
    asked = os.environ.get("CUDA_VISIBLE_DEVICES")
    if asked is None:
        return gpus
    seen = 0
    for item in (x.strip() for x in asked.split(",")):
        if not (item.startswith(("GPU-", "MIG-")) or item.isdigit() and int(item) < gpus):
            break
        seen += 1
    return seen


def check_device(device: str) -> None:
    """``resolve_device``'s refusals, without torch (a conversion checks before it writes anything, and
    one whose units need no torch never loads it): ``--device cuda`` where no CUDA device is visible
    (``visible_gpus``, or the CUDA driver asked on ``warm_cuda``'s thread). Where there is a device but
    torch has no CUDA (a CPU build of torch), ``resolve_device`` still refuses, if torch is loaded."""
    if device in ("auto", "cpu"):
        return
    if not (device == "cuda" or device.startswith("cuda:") and device[5:].isdigit()):
        raise InputError(f"--device {device}: not a device", hint="auto, cpu or cuda")
    warm_cuda(device, context=False)
    counted, box = _probes[device]
    counted.wait()
    if box[0] < 1:
        raise InputError(f"--device {device}: no CUDA device is available", hint="use --device cpu or auto")


def capability(device: str) -> tuple[int, int] | None:
    """The compute capability of the CUDA device ``device`` names (``requested_device``), from the
    driver through ctypes, without torch; None without a driver or a device."""
    name = requested_device(device)
    if not name.startswith("cuda"):
        return None
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), int(name.split(":", 1)[1])) != 0
                or cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0  # ..._COMPUTE_CAPABILITY_MAJOR
                or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0):  # ..._MINOR
            return None
    except (OSError, ValueError, AttributeError):
        return None
    return major.value, minor.value


def requested_device(device: str) -> str:
    """What ``resolve_device`` names for ``device``, as the CUDA driver sees it (no torch): a summary's
    ``device_requested`` where the units ran on the CPU without torch."""
    if device == "cpu" or device.startswith("cuda:"):
        return device
    if device not in ("auto", "cuda"):
        return "cpu"
    warm_cuda(device, context=False)
    counted, box = _probes[device]
    counted.wait()
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % box[0]}" if box[0] else "cpu"
