"""Verification of converted checkpoints: bytes, scales and kernels against the source.

``runner`` drives the checks; ``common`` holds what they share; ``dense`` and ``moe`` check the
modules of a ``mocli convert`` output (mirroring ``mocli.plan``), ``quantized`` a ``mocli quantize``
output; ``files`` checks whole files and verbatim tensors; ``expect`` derives what the bytes must be;
``early`` starts the digests before torch is imported.

The names below load on first use, so ``mocli.verify.early`` is importable without torch.
"""

from typing import Any

from mocli.progress import ModuleProgress as Progress

__all__ = ["THRESHOLDS", "Kernels", "Progress", "VerifyOptions", "verify"]


def __getattr__(name: str) -> Any:
    if name == "verify":
        from mocli.verify.runner import verify

        return verify
    if name in ("THRESHOLDS", "VerifyOptions"):
        from mocli.verify import results

        return getattr(results, name)
    if name == "Kernels":
        from mocli.devices import Kernels

        return Kernels
    raise AttributeError(f"module 'mocli.verify' has no attribute {name!r}")
