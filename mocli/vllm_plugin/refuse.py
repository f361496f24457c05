"""Refusals as the last line a user sees.

- ``register_refusal``: on a vLLM the plugin does not support, ``mocli`` is still a known quantization
  method, but loading a directory that declares it fails with one message naming the supported versions
  (instead of vLLM's "Unknown quantization method" or a half-working load). Uses only the two names that
  have been stable across vLLM releases.
- ``install_excepthook``: a plugin refusal raised in the process that runs ``vllm serve`` (or any script)
  propagates through vLLM's entry point to the interpreter, which would print ~35 lines of vLLM's
  traceback above the one line. The hook prints that line alone (``MOCLI_DEBUG=1``: the traceback too);
  every other exception goes to the previous hook unchanged. It cannot reach a refusal raised in a
  worker process: vLLM logs that one with its own traceback and raises its own error in the first.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from mocli.formats.layout import QUANT_METHOD

_HOOKED = "_mocli_refusal_hook"
DEBUG_ENV = "MOCLI_DEBUG"  # as mocli's CLI: 1 shows the traceback


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


def refusal_in(exc: BaseException | None) -> BaseException | None:
    """The plugin's refusal behind ``exc``: itself, a cause or context, or an error a pydantic
    ValidationError wraps (vLLM builds its configs with pydantic). A refusal is a ValueError whose message
    starts "mocli: " (checks.LayoutMismatch, and register_refusal's)."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ValueError) and str(e).startswith("mocli: ") and "\n" not in str(e):
            return e
        stack += [e.__cause__, e.__context__]
        errors = getattr(e, "errors", None)
        if callable(errors) and type(e).__name__ == "ValidationError":
            try:
                stack += [(d.get("ctx") or {}).get("error") for d in errors()]
            except Exception:  # noqa: BLE001 - not pydantic's errors() after all
                pass
    return None


def install_excepthook() -> None:
    """Once per process; chains to the hook it replaces."""
    previous = sys.excepthook
    if getattr(previous, _HOOKED, False):
        return

    def hook(exc_type, exc, tb):
        found = refusal_in(exc)
        if found is None or os.environ.get(DEBUG_ENV) == "1":
            return previous(exc_type, exc, tb)
        sys.stderr.write(f"{found}\n")
        sys.stderr.flush()
        return None

    setattr(hook, _HOOKED, True)
    sys.excepthook = hook
