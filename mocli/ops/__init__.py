"""Pure tensor transforms: no I/O, same bytes on CPU and CUDA.

Scalar scale arithmetic is done by the callers in float32 on the CPU and passed in as Python-free
0-dim float32 tensors, so that device math is only elementwise IEEE float32 and exact casts.
"""
