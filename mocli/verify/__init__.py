"""Verification of mocli's outputs: bytes, scales and kernels against the source.

``runner`` asks what the directory is (``mocli.formats.detect``) and runs that format's verifier:
a ``mocli convert`` output module by module through ``kinds`` (one check module per converted module
kind, numpy or torch as the kind needs; ``modules`` schedules them), ``quantized`` for a ``mocli
quantize`` output, ``repaired`` for a ``mocli repair`` one. ``source`` reads the source's tensors for
every check, ``expect`` derives what the bytes must be, ``cross`` the cross-rank properties,
``complete`` what must be there, ``files`` whole files and verbatim tensors; ``early`` starts the
digests before torch is imported.

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
