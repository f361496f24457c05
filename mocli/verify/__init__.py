"""Verification of converted checkpoints: bytes, scales and kernels against the source."""

from mocli.verify.modules import THRESHOLDS
from mocli.verify.runner import Progress, VerifyOptions, verify

__all__ = ["THRESHOLDS", "Progress", "VerifyOptions", "verify"]
