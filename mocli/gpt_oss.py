"""gpt-oss's own quantization config (``quant_method: "mxfp4"``), read as vLLM reads it (SEMANTICS §19.2).

vLLM's ``quantization/mxfp4.py :: Mxfp4Config.from_config`` reads nothing from the config (``cls()``: no ignored
layers) and ``get_quant_method`` builds every linear unquantized and every routed-experts layer MXFP4
(``GptOssMxfp4MoEMethod`` where ``model_type`` is ``gpt_oss``). So a module is MXFP4 iff it is an expert;
``modules_to_not_convert`` (transformers' exclusion list, the real gpt-oss's names attention, routers, embeddings
and the LM head) is kept as the config's exclusion list for inspect, not matched. The experts' 4-D tensors are
presented per expert by ``mocli.schemes.gpt_oss``.
"""

from __future__ import annotations

from typing import Any

from mocli.compressed_tensors import Resolver, _container
from mocli.findings import Findings
from mocli.quant_config import MXFP4_GROUP_SIZE, Algo, QuantConfig

METHOD = "mxfp4"


class ExpertsOnly(Resolver):
    """Every routed expert MXFP4, nothing else quantized (``Mxfp4Config.get_quant_method``)."""

    def __init__(self, findings: Findings, where: str) -> None:
        super().__init__({}, [], findings, where)

    def _resolve(self, module: str) -> Algo | None:
        return Algo.MXFP4 if _container(module) else None


def parse(q: dict[str, Any], where: str, findings: Findings) -> QuantConfig:
    """``config.json["quantization_config"]`` with ``quant_method: mxfp4``."""
    cfg = QuantConfig(origin="config.json", algo=Algo.MXFP4, method=METHOD, group_size=MXFP4_GROUP_SIZE,
                      producer={"name": "gpt-oss (quant_method mxfp4)", "version": None})
    keep = q.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(x, str) for x in keep):
        findings.add("CFG002", where, "modules_to_not_convert must be a list of strings")
        keep = []
    cfg.exclude_modules = list(keep)
    cfg.resolver = ExpertsOnly(findings, where)
    return cfg
