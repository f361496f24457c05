"""On a vLLM the plugin does not support: ``mocli`` is still a known quantization method, but
loading a directory that declares it fails with one message naming the supported versions (instead
of vLLM's "Unknown quantization method" or a half-working load). Uses only the two names that have
been stable across vLLM releases."""

from __future__ import annotations

from typing import Any

from mocli.formats.layout import QUANT_METHOD


def register_refusal(message: str) -> None:
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class MocliUnsupportedVllm(QuantizationConfig):  # never instantiated: from_config refuses
        @classmethod
        def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
            raise ValueError(message)

        def get_name(self) -> str:
            return QUANT_METHOD

        def get_supported_act_dtypes(self) -> list:
            return []

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        def get_quant_method(self, layer, prefix):
            return None

    register_quantization_config(QUANT_METHOD)(MocliUnsupportedVllm)
