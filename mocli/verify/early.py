"""The digests ``mocli verify`` will check, started before torch is imported.

Importing torch takes 2-3 s of one core (3.3 s on the H200 machine); hashing the output and the source
(twice the checkpoint's bytes) fills the other cores meanwhile. Torch-free on purpose. Only the plain
case is started here - a converted directory whose manifest reads, every rank checked, a local source
directory; anything else returns None and verify reads, hashes and reports exactly as it would
anyway (a digest started here is used only for the same file, algorithm and link rule).
"""

from __future__ import annotations

import os
from pathlib import Path

from mocli.errors import MocliError
from mocli.formats import source_spec
from mocli.formats.layout import file_path
from mocli.formats.manifest import Layout
from mocli.io.digests import BackgroundDigests, as_record


def start_digests(layout: Layout | None, source: str | None, rank: int | None) -> BackgroundDigests | None:
    """``layout``: the converted directory's manifest, as verify will check it (None: not a converted
    directory)."""
    if rank is not None or layout is None:  # one rank's files only: verify's own list
        return None
    try:
        out = layout.path
        jobs: list[tuple[Path, str, bool]] = []
        for rel, value in (layout.files or {}).items():
            record = as_record(value)
            if record is not None:
                jobs.append((file_path(out, rel), record[0], False))  # mocli's own files: never through a link
        provenance = layout.provenance or {}
        spec = source_spec(provenance, source)
        if spec is not None and Path(spec).is_dir():
            for name, value in (provenance.get("source_shards") or {}).items():
                record = as_record(value)
                if record is not None and isinstance(name, str) and os.sep not in name and not name.startswith("."):
                    jobs.append((Path(spec) / name, record[0], True))
        return BackgroundDigests(jobs) if jobs else None
    except (MocliError, OSError, ValueError, TypeError, AttributeError):
        return None


def gpu_context_wanted(layout: Layout | None, kernels) -> bool:
    """Whether this verify may run torch on the GPU, so that the device's CUDA context is worth starting
    now (``devices.warm_cuda``): not for a converted directory whose every module check runs in numpy and
    whose layout FlashInfer's NVFP4 kernels do not read (nor asked for). Made anyway, the context took a
    core for ~0.3 s on the H200 host (py-spy) while the checks were bound by the cores."""
    if layout is None:  # a quantized or repaired output: FP8 checks in torch
        return True
    from mocli.devices import Kernels
    from mocli.targets import layout_of
    from mocli.verify.kinds import CHECKS

    return Kernels(kernels) is Kernels.FLASHINFER or layout_of(layout.target).fp4_kernels or \
        any(CHECKS[m.kind].torch for m in layout.modules)
