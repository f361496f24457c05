"""What every serving kernel shares: where it runs, which path it takes there, and how it says so.

A path is chosen once per module from the device its tensors are on (SEMANTICS §9): real kernels
where the hardware has them (FP8 tensor cores from sm_89, grouped FP8 from sm_90, FlashInfer's
NVFP4 and fused-MoE kernels from sm_100 with flashinfer importable), otherwise emulation: mocli's
own decode of the layout (``mocli.targets`` inverses) and a GEMM of exactly representable values.
Emulation caches its decoded weights on first use; nothing else is computed at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from mocli.kinds import ModuleKind
from mocli.targets import TargetLayout


class ServeError(ValueError):
    """A converted module the kernels cannot run as stored (missing role, wrong shape or dtype)."""


@dataclass(frozen=True)
class Hardware:
    """Where a module's tensors live, and what that hardware offers."""

    type: str  # "cpu" | "cuda"
    cc: tuple[int, int] | None  # CUDA compute capability
    flashinfer: bool  # flashinfer importable (only looked for on sm_100+)

    @property
    def cuda(self) -> bool:
        return self.type == "cuda"

    def at_least(self, major: int, minor: int = 0) -> bool:
        return self.cc is not None and self.cc >= (major, minor)


def device_of(t: torch.Tensor) -> Hardware:
    if t.device.type != "cuda":
        return Hardware(t.device.type, None, False)
    cc = torch.cuda.get_device_capability(t.device)
    return Hardware("cuda", cc, cc >= (10, 0) and _flashinfer_importable())


@lru_cache(maxsize=1)
def _flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


F32, F8, U8 = torch.float32, torch.float8_e4m3fn, torch.uint8


Spec = dict[str, tuple[torch.dtype | None, tuple[int, ...]]]  # role -> (dtype or None: any, shape) on one rank


class Kernel:
    """One converted module, runnable. ``path`` names what runs (``emulated`` paths say so)."""

    kind: ModuleKind
    roles: tuple[str, ...]  # the tensors this kind needs
    path: str
    emulated: bool

    @classmethod
    def spec(cls, meta: Mapping[str, Any], layout: TargetLayout) -> Spec:
        """Every role this kind may hold, with its dtype and shape for the rank ``meta`` describes
        (LAYOUT.md's tables)."""
        raise NotImplementedError

    @classmethod
    def check(cls, shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], meta: Mapping[str, Any],
              layout: TargetLayout, name: str) -> None:
        """ServeError unless ``shapes`` (role -> (dtype, shape)) holds every needed role as LAYOUT.md says."""
        want = cls.spec(meta, layout)
        missing = [r for r in cls.roles if r not in shapes]
        if missing:
            raise ServeError(f"{name}: a {cls.kind} module needs {', '.join(missing)}")
        for role, (dtype, shape) in shapes.items():
            if role not in want:
                raise ServeError(f"{name}: a {cls.kind} module has no role {role!r}")
            want_dtype, want_shape = want[role]
            if tuple(shape) != want_shape or want_dtype is not None and dtype != want_dtype:
                raise ServeError(f"{name}.{role} is {_show(dtype, shape)}; the module's sizes give "
                                 f"{_show(want_dtype or dtype, want_shape)}")

    def __init__(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], layout: TargetLayout,
                 name: str = "") -> None:
        self.check({r: (t.dtype, tuple(t.shape)) for r, t in tensors.items()}, meta, layout, name or str(self.kind))
        self.t = dict(tensors)
        self.meta = dict(meta)
        self.layout = layout
        self.name = name or str(self.kind)
        self.device = device_of(next(iter(self.t.values())))
        self.path, self.emulated = self.select()

    def select(self) -> tuple[str, bool]:
        """(path, emulated) on ``self.device``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}: {self.path})"


def _show(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def gemm_dtype(device: Hardware) -> torch.dtype:
    """Emulation GEMMs: float32 on the CPU (BF16 there is slower and no more exact); BF16 tensor cores on
    CUDA, fed only values BF16 holds exactly (fp8 codes, e2m1 x fp8 block scale) unless noted."""
    return torch.bfloat16 if device.cuda else torch.float32


def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Emulation GEMM a @ w.T with a float32 result: the inputs are cast to ``w``'s dtype (values it holds
    exactly), BF16 products accumulate in float32 and are not rounded back to BF16 (a rounded GEMM1 output
    would move codes of the re-quantized intermediate)."""
    a = a.to(w.dtype)
    if w.dtype == torch.bfloat16:
        return torch.mm(a, w.T, out_dtype=torch.float32)
    return a @ w.T


def row_order(layout: TargetLayout, rows: int, gated: bool, device: torch.device) -> torch.Tensor | None:
    """Stored row index of each logical row of one expert's w13 / w2 (None: stored in logical order).
    Decoding an index column with the layout's own inverse gives it, so a GEMM on the stored rows can
    gather its output columns instead of copying the weights."""
    idx = layout.moe_rows_decode(torch.arange(rows).reshape(rows, 1), gated=gated).reshape(rows)
    return None if bool((idx == torch.arange(rows)).all()) else idx.to(device)
