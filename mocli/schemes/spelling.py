"""How an input format spells a stored scheme's tensors: file suffix -> canonical role, and which
canonical scales it stores as divisors (the float32 reciprocal of the dequant scale mocli works with).

ModelOpt's names are the canonical ones. compressed-tensors (llm-compressor) stores the same NVFP4 bytes
under other names, with its global scales as divisors (SEMANTICS §17.1): ``weight_packed`` is the
weight, ``weight_global_scale`` = 1 / ``weight_scale_2``, ``input_global_scale`` = 1 / ``input_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE_2


@dataclass(frozen=True)
class Spelling:
    name: str
    suffixes: dict[str, str] = field(default_factory=dict)  # file suffix -> canonical suffix (others: as they are)
    divisors: frozenset[str] = frozenset()  # canonical suffixes stored as 1 / value

    def canonical(self, suffix: str) -> str:
        return self.suffixes.get(suffix, suffix)


MODELOPT = Spelling("modelopt")
COMPRESSED_TENSORS = Spelling(
    "compressed-tensors",
    {"weight_packed": WEIGHT, "weight_global_scale": WEIGHT_SCALE_2, "input_global_scale": INPUT_SCALE},
    frozenset({WEIGHT_SCALE_2, INPUT_SCALE}))
