"""How an input format spells a stored scheme's tensors: file suffix -> canonical role, which canonical
scales it stores as divisors (the float32 reciprocal of the dequant scale mocli works with), and the scale
dtypes and one-value shapes it writes besides ModelOpt's.

ModelOpt's names are the canonical ones. compressed-tensors (llm-compressor) stores the same NVFP4 bytes
under other names, with its global scales as divisors (SEMANTICS §17.1): ``weight_packed`` is the
weight, ``weight_global_scale`` = 1 / ``weight_scale_2``, ``input_global_scale`` = 1 / ``input_scale``;
its FP8 and KV scales are often BF16, and a per-tensor scale is [1] rather than 0-dim (§17.2).
A new input format is one ``Spelling`` here and one entry in ``mocli.checkpoint.INPUT_FORMATS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2

if TYPE_CHECKING:
    from mocli.io.safetensors_file import TensorEntry


@dataclass(frozen=True)
class Spelling:
    name: str
    suffixes: dict[str, str] = field(default_factory=dict)  # file suffix -> canonical suffix (others: as they are)
    # file suffixes stored as 1 / value (the file's name tells: compressed-tensors' FP8 ``input_scale`` is the
    # same role as its NVFP4 ``input_global_scale``, but a dequant scale)
    divisors: frozenset[str] = frozenset()
    float_scales: frozenset[str] = frozenset({"F32"})  # dtypes a float32 scale may be stored in (widened exactly)
    one_value: tuple[tuple[int, ...], ...] = ((),)  # shapes a per-tensor scale may have
    # per-tensor FP8: every linear and every MoE w1/w3 half requantized through vLLM's float16 intermediate,
    # at equal scales too (vLLM's compressed-tensors path, SEMANTICS §17.2); else §3's float32, equal kept
    fp8_requant_f16: bool = False
    # modules whose tensors hold several modules each, split into them (module -> canonical suffix -> entry, as
    # the census groups them): gpt-oss's [E, N, K/32, 16] expert blocks into per-expert modules
    expand: Callable[[dict[str, dict[str, TensorEntry]]], dict[str, dict[str, TensorEntry]]] | None = None

    def canonical(self, suffix: str) -> str:
        return self.suffixes.get(suffix, suffix)

    def source(self, suffix: str) -> str:
        """The file's own name for a canonical suffix (findings speak the source's names)."""
        return next((s for s, c in self.suffixes.items() if c == suffix), suffix)

    def is_divisor(self, tensor_name: str) -> bool:
        return tensor_name.rpartition(".")[2] in self.divisors

    def scale_dtype_ok(self, got: str, wanted: str) -> bool:
        return got == wanted or wanted == "F32" and got in self.float_scales


MODELOPT = Spelling("modelopt")
COMPRESSED_TENSORS = Spelling(
    "compressed-tensors",
    {"weight_packed": WEIGHT, "weight_global_scale": WEIGHT_SCALE_2, "input_global_scale": INPUT_SCALE},
    frozenset({"weight_global_scale", "input_global_scale"}),
    float_scales=frozenset({"F32", "BF16", "F16"}),
    one_value=((), (1,)),
    fp8_requant_f16=True)

# vLLM's own serialized fp8: 128x128-block scales are ``weight_scale_inv`` (DeepSeek-V3's name; a dequant scale
# despite it, SEMANTICS §18.4), per-tensor ones ``weight_scale``
VLLM_FP8 = Spelling("fp8", {"weight_scale_inv": WEIGHT_SCALE})

# AMD Quark (``quant_method: "quark"``): ModelOpt's names (``weight``, ``weight_scale``), U8 E8M0 scales for MXFP4
# (SEMANTICS §19.2)
QUARK = Spelling("quark")
