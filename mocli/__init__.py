"""mocli: inspect, validate, convert and verify NVIDIA ModelOpt quantized checkpoints."""

__version__ = "0.2.0"
