"""The serving engines whose reading of a checkpoint ``validate --engine`` checks, one module each.

vLLM's rules are validate's own (SEMANTICS §2; the EXC and CFG findings); SGLang's differ in exclusion
matching and in the algorithms each config class takes (``sglang``: SGL findings). ``ENGINES`` maps
``--engine`` to the engines checked.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mocli.quant_config import QuantConfig


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    ALL = "all"


ENGINES: dict[Engine, frozenset[str]] = {
    Engine.VLLM: frozenset({"vllm"}),
    Engine.SGLANG: frozenset({"sglang"}),
    Engine.ALL: frozenset({"vllm", "sglang"}),
}

# The engines in the order validate names them, and the versions whose source their rules restate
# (vLLM: the 0.32.0 CPU wheel the tests serve on and 0.33.0, SEMANTICS; SGLang: sglang.VERSION's wheel)
ORDER = ("vllm", "sglang")
LABELS = {"vllm": "vLLM 0.32-0.33", "sglang": "SGLang 0.5.23"}


def unjudged(engine: str, quant: QuantConfig | None) -> str | None:
    """Why validate cannot judge this engine's reading of a checkpoint configured so (None: it can)."""
    if engine == "sglang" and quant is not None and quant.method == "compressed-tensors":
        return "its reading of compressed-tensors is not restated by mocli (SEMANTICS §17 is vLLM's): no SGL check ran"
    if engine == "sglang" and quant is not None and (quant.method in UNRESTATED or quant.algo == "MXFP4"):
        return (f"its reading of {quant.method if quant.method in UNRESTATED else 'ModelOpt MXFP4'} is not restated by "
                "mocli (SEMANTICS §19 is vLLM's): no SGL check ran")
    return None


# input formats whose SGLang reading mocli has not restated (quant_method; SEMANTICS §19)
UNRESTATED = frozenset({"quark", "mxfp4"})


__all__ = ["ENGINES", "LABELS", "ORDER", "Engine", "unjudged"]
