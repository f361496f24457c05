"""Verification of converted checkpoints: bytes, scales and kernels against the source.

``runner`` drives the checks; ``common`` holds what they share; ``dense`` and ``moe`` check the
modules of a ``mocli convert`` output (mirroring ``mocli.plan``), ``quantized`` a ``mocli quantize``
output; ``files`` checks whole files and verbatim tensors; ``expect`` derives what the bytes must be.
"""

from mocli.progress import ModuleProgress as Progress
from mocli.verify.common import THRESHOLDS, Kernels, VerifyOptions
from mocli.verify.runner import verify

__all__ = ["THRESHOLDS", "Kernels", "Progress", "VerifyOptions", "verify"]
