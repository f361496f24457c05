"""The compiled parts: Marlin's NVFP4 weight repack (csrc/marlin_repack.c, the converter's) and its inverse
(csrc/marlin_decode.c, verify's and serving's, written apart), and a reader of the safetensors headers the
safetensors library writes (csrc/safetensors_header.c), built where a C compiler and Python's headers are
found. ``optional``: without one, pip installs mocli anyway and the same bytes come from numpy
(``mocli.ops.marlin_native.OK``, ``mocli.targets.marlin_decode.NATIVE``), the same headers from orjson
(``mocli.io.header``). Limited API: one build serves
every CPython from 3.11. Everything else is in pyproject.toml."""

from setuptools import Extension, setup


def _ext(name: str, source: str) -> Extension:
    return Extension(name, [source], optional=True, py_limited_api=True, extra_compile_args=["-O3"])


setup(ext_modules=[_ext("mocli.ops._marlin_repack", "csrc/marlin_repack.c"),
                   _ext("mocli.targets._marlin_decode", "csrc/marlin_decode.c"),
                   _ext("mocli.io._safetensors_header", "csrc/safetensors_header.c")],
      options={"bdist_wheel": {"py_limited_api": "cp311"}})  # a wheel tagged for every CPython from 3.11
