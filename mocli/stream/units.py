"""What the stream runner runs: work units, the pieces of bytes they produce, and the output tensors they fill.

Planning (convert's ``mocli.plan``, ``mocli.repair``, ``mocli.quantize``) decides every output tensor's
name, dtype, shape and place before any weight byte moves; the stream runner then runs the units and writes
each piece straight to its place. A piece is either computed bytes (a tensor) or a range of source
bytes copied verbatim, which the stream runner moves in the kernel (``copy_file_range``) without reading it
into Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mocli.io.safetensors_file import DTYPE_SIZES, TensorEntry

if TYPE_CHECKING:
    import numpy as np
    import torch

Key = tuple[str, str]  # (group: "" or "rank-N", tensor name)
# Verbatim copies are batched into units of about this many bytes or tensors.
BATCH_BYTES = 64 << 20
BATCH_TENSORS = 512


@dataclass
class OutTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    role: str
    sources: list[str]
    transforms: list[str]
    group: str = ""

    @property
    def key(self) -> Key:
        return self.group, self.name

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "role": self.role,
                "sources": self.sources, "transforms": self.transforms}


@dataclass(frozen=True)
class SourceRange:
    """``nbytes`` bytes of a source tensor, from ``start`` bytes into it, copied unchanged."""

    entry: TensorEntry
    start: int
    nbytes: int

    def rows(self, a: int, b: int) -> SourceRange:
        """Rows [a, b) of a 2-D (or 3-D, first dim) tensor: contiguous bytes."""
        row = self.nbytes // self.entry.shape[0]
        return SourceRange(self.entry, self.start + a * row, (b - a) * row)


@dataclass
class Piece:
    """Bytes for part of one output tensor: ``data`` goes ``offset`` bytes into the tensor ``key``."""

    key: Key
    offset: int
    data: torch.Tensor | np.ndarray | SourceRange

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class BadData(Exception):
    """Bytes that no layout can carry: NaN codes in FP8 weights or block scales (DAT001), a scale computed
    from finite ones that is not finite (SCL006, ``check_finite``). The run is refused, nothing is kept."""

    def __init__(self, tensor: str, message: str, code: str = "DAT001", hint: str = "") -> None:
        super().__init__(f"{tensor}: {message}")
        self.tensor, self.message, self.code = tensor, message, code
        self.hint = hint or "the export is broken; re-export the checkpoint"


# Output dtypes a scale is written in -> (word, exponent mask): all exponent bits set is Inf or NaN.
_FLOAT_WORDS = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}
# Roles whose values are not scales: weights (and a bias) are the source's own values, moved, never computed
# here; ``passthrough`` tensors are copied as they are.
NOT_SCALES = frozenset({"weight", "w13_weight", "w2_weight", "bias", "passthrough"})


def check_finite(pieces: list[Piece], tensors: dict[Key, OutTensor]) -> None:
    """Every scale a unit computed (a piece of memory, not a source range, of a float tensor whose role is a
    scale) is finite, whatever the command or target: the one check at the point computed scales are
    written. Raises BadData (SCL006) naming the tensor and the value; validate predicts the same cases
    from the plan (``mocli.validate.computed``), so this fires only where a prediction missed one."""
    import numpy as np

    for p in pieces:
        t = tensors.get(p.key)
        if isinstance(p.data, SourceRange) or t is None or t.role in NOT_SCALES or t.dtype not in _FLOAT_WORDS:
            continue
        word, mask = _FLOAT_WORDS[t.dtype]
        raw = np.ascontiguousarray(p.data).reshape(-1).view(np.uint8) if isinstance(p.data, np.ndarray) \
            else _tensor_bytes(p.data)
        if raw.size % np.dtype(word).itemsize:
            continue
        bad = np.flatnonzero((raw.view(word) & mask) == mask)
        if bad.size:
            value = _decoded(raw, t.dtype, int(bad[0]))
            where = f" on {t.group}" if t.group else ""
            raise BadData(t.name + where, f"computed {t.role} is {value} (element {int(bad[0])}; "
                          f"{', '.join(t.transforms) or 'computed'}), not a finite {t.dtype}", code="SCL006",
                          hint="the source's scales are finite but this target's arithmetic overflows on them; "
                               "nothing was written: convert for another target or re-calibrate the export")


def _tensor_bytes(t):
    """A torch tensor's bytes as a uint8 numpy array (bfloat16 has no numpy dtype; torch is loaded already)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _decoded(raw, dtype: str, i: int) -> str:
    import numpy as np

    if dtype == "BF16":
        v = (raw.view("<u2")[i:i + 1].astype(np.uint32) << 16).view(np.float32)[0]
    else:
        v = raw.view("<f4" if dtype == "F32" else "<f2")[i]
    return str(float(v))



@dataclass
class Unit:
    id: str
    inputs: list[TensorEntry]
    outputs: list[Key]
    run: Callable[..., list[Piece]]  # called with the stream runner's UnitContext (mocli.stream.pool)
    # Every weight byte goes through memory to be transformed (FP8 NaN checks and requantization,
    # quantization, trtllm's row shuffles): what a GPU does faster than the one CPU thread that runs
    # units. Weights copied as they are (in the kernel) with small scale tensors swizzled beside them
    # are not; a plan without such units runs on the CPU even under --device cuda (``Plan.compute``).
    compute: bool = False
    # ``run`` needs no torch: its pieces are source ranges or numpy arrays made on the CPU (the context's
    # device is None), and it borrows no pooled buffers. A process whose units are all so (an NVFP4
    # conversion: ``mocli.ops.nvfp4``) never imports torch.
    torch_free: bool = False
    # a torch-free unit that moves its bytes through the GPU where the run is asked for CUDA (its ``run``
    # sees the context's device; the CPU path otherwise): the Marlin repack (``mocli.ops.marlin_torch``)
    gpu: bool = False
    # a torch-free unit whose output arrays come from ``UnitContext.empty``: in a worker process they are
    # made in its slot and written from there, nothing copied (the Marlin repacks and scale moves); what
    # makes workers pay on a machine of few cores (``mocli.stream.job.REMOTE_MIN_BYTES``)
    in_place: bool = False
    # the bytes it reads where that is a part of its inputs (a Marlin dense weight repacked in parts, each
    # some K columns of every row): what progress, scheduling and the workers go by
    reads: int | None = None

    @property
    def input_bytes(self) -> int:
        return self.reads if self.reads is not None else sum(e.nbytes for e in self.inputs)



@dataclass
class Plan:
    """Every output tensor (by (group, name)) and the units that produce them. Convert's planner adds
    the manifest's modules (``mocli.plan.ConvertPlan``)."""

    tensors: dict[Key, OutTensor] = field(default_factory=dict)
    units: list[Unit] = field(default_factory=list)

    @property
    def compute(self) -> bool:
        """Whether any unit computes over weight bytes (see ``Unit.compute``)."""
        return any(u.compute for u in self.units)

    def add(self, t: OutTensor) -> str:
        if t.key in self.tensors:
            raise ValueError(f"output tensor {t.name} planned twice in group {t.group!r}")
        self.tensors[t.key] = t
        return t.name

    def copy_units(self, entries: list, group: str = "", role: str = "passthrough") -> None:
        """``entries`` (source tensors) copied verbatim under their own names, in order, batched into
        units of about BATCH_BYTES / BATCH_TENSORS; the stream runner moves their bytes in the kernel."""
        batch: list[TensorEntry] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if batch:
                keys = [(group, e.name) for e in batch]
                pieces = [Piece((group, e.name), 0, SourceRange(e, 0, e.nbytes)) for e in batch]
                self.units.append(Unit(f"copy:{batch[0].name}", list(batch), keys, lambda ctx, p=pieces: p,
                                       torch_free=True))
            batch, size = [], 0

        for e in entries:
            self.add(OutTensor(e.name, e.dtype, e.shape, role, [e.name], [], group))
            batch.append(e)
            size += e.nbytes
            if size >= BATCH_BYTES or len(batch) >= BATCH_TENSORS:
                flush()
        flush()


def concat_pieces(key: Key, parts: list[torch.Tensor | SourceRange], start: int = 0) -> list[Piece]:
    """Pieces that lay ``parts`` end to end from byte ``start`` of tensor ``key``."""
    out, off = [], start
    for p in parts:
        piece = Piece(key, off, p)
        out.append(piece)
        off += piece.nbytes
    return out
