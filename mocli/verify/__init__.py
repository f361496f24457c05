"""Verification of converted checkpoints: kernels vs. a float32 reference from the source."""

from mocli.verify.runner import THRESHOLDS, Progress, VerifyOptions, verify

__all__ = ["THRESHOLDS", "Progress", "VerifyOptions", "verify"]
