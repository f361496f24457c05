"""Number formats as verify and the serving kernels read them: e4m3 and e2m1 codes, the activation
quantization models of the FP8 and NVFP4 kernels, the source's dequantization.

One definition of each format, in two libraries side by side (safetensors keeps one core and thin
per-framework modules): ``in_numpy`` (verify's NVFP4 checks, no torch) and ``in_torch`` (verify's FP8
checks and ``mocli.serve``); ``tests/test_verify_numeric.py`` holds the two bit-equal. The converter
encodes with its own byte tables (``mocli.ops``), written apart on purpose, so that a wrong encoder
cannot pass its own check: that is the other place the e4m3 maximum is defined.
"""

FP8_MAX = 448.0  # largest finite e4m3fn value
E2M1_MAX = 6.0  # largest e2m1 magnitude
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code (bits 0-2; bit 3 is the sign)
