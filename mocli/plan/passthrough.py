"""Tensors that pass through unchanged: unquantized weights, excluded layers, KV-cache scales.

Not sliced per rank (engines slice BF16 cheaply and pad the vocabulary their own way, SEMANTICS
§10): written once, at the top level, as verbatim source bytes the kernel copies.
"""

from __future__ import annotations

from mocli.io.safetensors_file import TensorEntry
from mocli.plan.core import OutTensor, Piece, Plan, SourceRange, Unit

BATCH_BYTES = 64 << 20
BATCH_TENSORS = 512


def plan_passthrough(plan: Plan, entries: list[TensorEntry], group: str = "") -> None:
    """One output tensor per entry, same name and bytes, in batches of units."""
    entries = sorted(entries, key=lambda e: (str(e.file), e.start))
    batch: list[TensorEntry] = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            keys = [(group, e.name) for e in batch]
            pieces = [Piece((group, e.name), 0, SourceRange(e, 0, e.nbytes)) for e in batch]
            plan.units.append(Unit(f"copy:{batch[0].name}", list(batch), keys, lambda ctx, p=pieces: p))
        batch, size = [], 0

    for e in entries:
        plan.add(OutTensor(e.name, e.dtype, e.shape, "passthrough", [e.name], [], group))
        batch.append(e)
        size += e.nbytes
        if size >= BATCH_BYTES or len(batch) >= BATCH_TENSORS:
            flush()
    flush()
