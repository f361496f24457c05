"""Building hundreds of thousands of small objects at once (headers, census)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector while building acyclic bulk data: with ~100k tensors it would run
    hundreds of times for nothing (measured: 20% of inspect on a 94,858-tensor checkpoint)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
