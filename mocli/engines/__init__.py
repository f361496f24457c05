"""The serving engines whose reading of a checkpoint ``validate --engine`` checks, one module each.

vLLM's rules are validate's own (SEMANTICS §2; the EXC and CFG findings); SGLang's differ in exclusion
matching and in the algorithms each config class takes (``sglang``: SGL findings). ``ENGINES`` maps
``--engine`` to the engines checked.
"""

from __future__ import annotations

from enum import StrEnum


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    ALL = "all"


ENGINES: dict[Engine, frozenset[str]] = {
    Engine.VLLM: frozenset({"vllm"}),
    Engine.SGLANG: frozenset({"sglang"}),
    Engine.ALL: frozenset({"vllm", "sglang"}),
}

__all__ = ["ENGINES", "Engine"]
