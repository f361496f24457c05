"""The source checkpoint's tensors, on demand, for every check: read-only numpy views of the page cache
(NVFP4 checks, in numpy) or torch views and device copies (FP8 checks), one reader for both.

Torch is imported only by the torch methods, so an NVFP4 verify never loads it. Tensors are found by
the module's canonical roles (``mocli.census``), whatever the source's spelling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from mocli.census import Census, Module
from mocli.errors import CorruptFileError
from mocli.numerics.in_numpy import E4M3, dequant_nvfp4, scaled_matmul
from mocli.tables import WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2

if TYPE_CHECKING:
    import torch

    from mocli.checkpoint import Checkpoint


def floats(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of a safetensors tensor read as numpy (``TensorReader.array``: BF16 and F8 as
    their raw words)."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E4M3":
        return E4M3[a]
    return a.astype(np.float32)


class SourceTensors:
    """Source tensors on demand. ``device``: where the torch methods put them (None: numpy only)."""

    def __init__(self, ckpt: Checkpoint, census: Census, reader, device: torch.device | None = None) -> None:
        self.ckpt, self.census, self.reader, self.device = ckpt, census, reader, device
        self.layers = {layer.name: layer for layer in census.moe}
        self.fetched: dict[str, torch.Tensor] = {}  # on the verify device, inside on_device()

    def module(self, name: str) -> Module:
        return self.census.modules[name]

    # --- numpy -------------------------------------------------------------------------------------

    def arr(self, name: str) -> np.ndarray:
        return self.reader.array(self.ckpt.tensors[name])

    def floats(self, name: str) -> np.ndarray:
        return floats(self.arr(name), self.ckpt.tensors[name].dtype)

    def scalar(self, m: Module, suffix: str) -> np.float32:
        """A per-tensor scale of module ``m`` (its canonical ``suffix``) as float32."""
        name = m.tensors[suffix].name
        v = self.floats(name)
        if self.census.spelling.is_divisor(name):  # a divisor on file (compressed-tensors): its reciprocal
            v = np.reciprocal(v.astype(np.float32))
        if v.size != 1:
            raise CorruptFileError(f"{name}: a per-tensor scale with {v.size} values",
                                   hint="the source is not the per-tensor export it was converted from")
        return np.float32(v.reshape(()))

    def inverse(self, m: Module, suffix: str) -> np.float32:
        """1 / the per-tensor scale ``suffix`` of ``m``: the divisor itself where the file stores one (vLLM's
        compressed-tensors linear keeps it, SEMANTICS §17.3), else the float32 reciprocal."""
        if self.census.spelling.is_divisor(m.tensors[suffix].name):
            return np.float32(self.floats(m.tensors[suffix].name).reshape(()))
        return np.reciprocal(self.scalar(m, suffix))

    def nvfp4_dequant(self, m: Module, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 [N, K] of one NVFP4 source linear (or its ``rows``), from its own scales."""
        w, bs = self.arr(m.tensors[WEIGHT].name), self.arr(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w, bs = w[rows], bs[rows]
        return dequant_nvfp4(w, bs, self.scalar(m, WEIGHT_SCALE_2))

    def nvfp4_matmul(self, x: np.ndarray, m: Module, rows: tuple[int, int] | None = None,
                     cols: tuple[int, int] | None = None) -> np.ndarray:
        """``x @ W.T`` for the NVFP4 source linear W dequantized from its own scales (``rows`` / ``cols``: a
        slice of W's output / input dims), without W ever whole in float32 (``scaled_matmul``)."""
        w, bs = self.arr(m.tensors[WEIGHT].name), self.arr(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w, bs = w[rows[0]:rows[1]], bs[rows[0]:rows[1]]
        if cols is not None:
            w, bs = w[:, cols[0] // 2:cols[1] // 2], bs[:, cols[0] // 16:cols[1] // 16]
        return scaled_matmul(x, w, bs, self.scalar(m, WEIGHT_SCALE_2))

    # --- torch -------------------------------------------------------------------------------------

    def cpu(self, name: str) -> torch.Tensor:
        """A copy-free torch view of the source tensor's bytes (page cache)."""
        return self.reader.view(self.ckpt.tensors[name])

    def near(self, name: str) -> torch.Tensor:
        """The tensor on the verify device if on_device() put it there, else the page-cache view."""
        t = self.fetched.get(name)
        return t if t is not None else self.cpu(name)

    def scalar_t(self, m: Module, suffix: str) -> torch.Tensor:
        """``scalar`` as a 0-dim float32 torch tensor (on the CPU)."""
        import torch

        return torch.from_numpy(np.asarray(self.scalar(m, suffix)))

    @contextmanager
    def on_device(self, names: list[str]) -> Iterator[None]:
        """CUDA: these tensors (a MoE layer's expert weights and block scales) on the device while the
        block runs, read in one span per file through pinned staging (mocli.loader.load_tensors) instead
        of one pageable copy per tensor and use; ``near`` hands them out. Files where the names are
        scattered (span over twice their bytes) are left to the per-tensor path."""
        if self.device is None or self.device.type != "cuda":
            yield
            return
        from mocli.loader import load_tensors

        by_file: dict = {}
        for n in names:
            e = self.ckpt.tensors[n]
            by_file.setdefault(e.file, []).append(e)
        bulk = [e for es in by_file.values()
                if max(e.start + e.nbytes for e in es) - min(e.start for e in es) <= 2 * sum(e.nbytes for e in es)
                for e in es]
        self.fetched = load_tensors(bulk, self.device, follow=True)
        try:
            yield
        finally:
            self.fetched = {}  # one layer's source bytes on the device at a time

    def fp8_dequant(self, m: Module, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N, K] of one FP8 source linear (or its ``rows``), from its own scales, on the device."""
        import torch

        from mocli.numerics.in_torch import dequant_fp8

        w = self.near(m.tensors[WEIGHT].name)
        scale = self.near(m.tensors[WEIGHT_SCALE].name)
        if rows is not None:
            w = w.view(torch.uint8)[rows].view(w.dtype)
        if rows is not None and scale.numel() > 1:  # ModelOpt's 0-dim and compressed-tensors' [1] are per tensor
            n = m.out_in[0]
            if scale.numel() == n:  # per channel
                scale = scale.reshape(-1)[rows]
            else:  # 128x128 blocks: the block row of each selected row, as a per-row block vector
                blocks = scale.reshape(n // 128, -1)[rows // 128]
                return (w.float() * blocks.repeat_interleave(128, dim=1)).to(self.device)
        return dequant_fp8(w.to(self.device), scale.to(self.device))
