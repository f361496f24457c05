"""Every vLLM name the plugin touches, as data: what ``register()`` can check before it registers anything,
and what ``tests/vllm_compat.py`` resolves in a release's source without installing it. No vLLM import here.

``params``: the leading parameter names (after self/cls), in order; None: the signature is not checked. A call
(the default) needs them and no other required parameter; an ``override`` (vLLM calls the plugin's method)
needs exactly them. ``kwargs_ok``: passed by keyword, so a ``**kwargs`` on the receiving side takes what it
does not name. ``implements``: what the plugin's subclass defines; it must cover every abstract method of the
class. ``private``: a patched or leading-underscore name, which vLLM does not promise to keep.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MODULE, CLASS, FUNCTION, METHOD, ATTRIBUTE, DICT = "module", "class", "function", "method", "attribute", "dict"
VARIADIC = ("VAR_POSITIONAL", "VAR_KEYWORD")


@dataclass(frozen=True)
class Requirement:
    module: str  # import path, as the plugin imports it
    name: str  # qualified name in that module ("Class.member"); "" for the module itself
    kind: str
    params: tuple[str, ...] | None = None
    override: bool = False
    kwargs_ok: bool = False
    patched: bool = False  # the plugin replaces it at run time
    implements: tuple[str, ...] = ()
    # what the plugin does without it ("": nothing, so the plugin refuses to register on a vLLM that lacks it)
    fallback: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module

    @property
    def private(self) -> bool:
        return self.patched or any(p.startswith("_") and not p.startswith("__") for p in self.path.split("."))


R, LAYERS, TORCH_UTILS, CONFIG = Requirement, "vllm.model_executor.layers", "vllm.utils.torch_utils", "vllm.config"
QUANT, LINEAR, MOE, ATTN = f"{LAYERS}.quantization", f"{LAYERS}.linear", f"{LAYERS}.fused_moe", f"{LAYERS}.attention"
QC, KV, MODELS = f"{QUANT}.base_config", f"{QUANT}.kv_cache", "vllm.model_executor.models.utils"
LOADER, BASE = "vllm.model_executor.model_loader", "vllm.model_executor.model_loader.base_loader"
MARLIN_FP4, MARLIN_UTILS = f"{QUANT}.utils.marlin_utils_fp4", f"{QUANT}.utils.marlin_utils"
DECODED = "marlin outputs run on mocli's decode of their layout (BF16 GEMMs), not on vLLM's Marlin kernels"
QUANT_METHOD = ("create_weights", "process_weights_after_loading", "apply")  # what both methods.py classes define

REQUIREMENTS: tuple[Requirement, ...] = (
    R("vllm", "__version__", ATTRIBUTE),  # __init__.register: supported or refused
    R(QUANT, "register_quantization_config", FUNCTION, ("quantization",)),  # engine.register_all, refuse
    # config.MocliConfig and refuse.MocliUnsupportedVllm subclass it
    R(QC, "QuantizationConfig", CLASS, implements=(
        "from_config", "get_name", "get_supported_act_dtypes", "get_min_capability", "get_config_filenames",
        "get_quant_method", "maybe_update_config", "apply_vllm_mapper")),
    R(QC, "QuantizationConfig.__init__", METHOD, ()),  # MocliConfig.__init__: super().__init__()
    R(QC, "QuantizationConfig.from_config", METHOD, ("config",), override=True),  # MocliConfig, a classmethod
    R(QC, "QuantizationConfig.get_name", METHOD, (), override=True),  # MocliConfig: "mocli"
    R(QC, "QuantizationConfig.get_supported_act_dtypes", METHOD, (), override=True),  # MocliConfig
    R(QC, "QuantizationConfig.get_min_capability", METHOD, (), override=True),  # MocliConfig, a classmethod
    R(QC, "QuantizationConfig.get_config_filenames", METHOD, (), override=True),  # MocliConfig, a staticmethod
    R(QC, "QuantizationConfig.get_quant_method", METHOD, ("layer", "prefix"), override=True),  # MocliConfig
    # MocliConfig.maybe_update_config: reads the layout manifest in the first process
    R(QC, "QuantizationConfig.maybe_update_config", METHOD, ("model_name", "hf_config", "revision"), override=True),
    R(QC, "QuantizationConfig.apply_vllm_mapper", METHOD, ("hf_to_vllm_mapper",), override=True),  # MocliConfig
    R(MODELS, "WeightsMapper.map_name", METHOD, ("key",)),  # MocliConfig.module_for, on that mapper
    R(QC, "QuantizeMethodBase", CLASS),  # config: get_quant_method's return annotation
    R(QC, "QuantizeMethodBase.supports_pre_processed_weights", ATTRIBUTE),  # both methods.py classes: True
    R(KV, "BaseKVCacheMethod", CLASS),  # MocliConfig.get_quant_method for attention; loader._check_filled
    R(KV, "BaseKVCacheMethod.__init__", METHOD, ("quant_config",)),  # MocliConfig: BaseKVCacheMethod(self)
    R(ATTN, "Attention", CLASS),  # MocliConfig.get_quant_method: isinstance
    R(ATTN, "MLAAttention", CLASS),  # MocliConfig.get_quant_method: isinstance
    R(LINEAR, "LinearBase", CLASS),  # MocliConfig.get_quant_method: isinstance
    R(LINEAR, "LinearBase.quant_method", ATTRIBUTE),  # loader._converted_layers
    R(LINEAR, "LinearBase.quant_config", ATTRIBUTE),  # loader._mocli_config
    R(LINEAR, "UnquantizedLinearMethod", CLASS),  # MocliConfig.get_quant_method: layers the layout lacks
    R(LINEAR, "LinearMethodBase", CLASS, implements=QUANT_METHOD),  # methods.MocliLinearMethod subclasses it
    # MocliLinearMethod.create_weights: vLLM passes these by keyword
    R(LINEAR, "LinearMethodBase.create_weights", METHOD, ("layer", "input_size_per_partition",
      "output_partition_sizes", "input_size", "output_size", "params_dtype"), override=True, kwargs_ok=True),
    R(LINEAR, "LinearMethodBase.process_weights_after_loading", METHOD, ("layer",),  # MocliLinearMethod
      override=True),
    R(LINEAR, "LinearMethodBase.apply", METHOD, ("layer", "x", "bias"), override=True),  # MocliLinearMethod.apply
    R(MOE, "FusedMoEMethodBase", CLASS,  # methods.MocliMoEMethod subclasses it
      implements=(*QUANT_METHOD, "maybe_roundup_sizes", "get_fused_moe_quant_config")),
    R(MOE, "FusedMoEMethodBase.__init__", METHOD, ("moe",)),  # MocliMoEMethod.__init__: super().__init__(moe)
    # MocliMoEMethod.create_weights: vLLM passes these by keyword
    R(MOE, "FusedMoEMethodBase.create_weights", METHOD, ("layer", "num_experts", "hidden_size",
      "intermediate_size_per_partition", "params_dtype"), override=True, kwargs_ok=True),
    # MocliMoEMethod.maybe_roundup_sizes: the layout is unpadded (vLLM passes these positionally)
    R(MOE, "FusedMoEMethodBase.maybe_roundup_sizes", METHOD, ("hidden_size", "intermediate_size_per_partition",
      "act_dtype", "moe_parallel_config"), override=True),
    R(MOE, "FusedMoEMethodBase.get_fused_moe_quant_config", METHOD, ("layer",), override=True),  # MocliMoEMethod
    R(MOE, "FusedMoEMethodBase.process_weights_after_loading", METHOD, ("layer",), override=True),  # MocliMoEMethod
    # MocliMoEMethod.apply: this rank's routed experts, unreduced (vLLM passes these by keyword)
    R(MOE, "FusedMoEMethodBase.apply", METHOD, ("layer", "x", "topk_weights", "topk_ids", "shared_experts",
      "shared_experts_input"), override=True),
    R(MOE, "RoutedExperts", CLASS),  # MocliConfig.get_quant_method: isinstance
    R(MOE, "RoutedExperts.moe_config", ATTRIBUTE),  # MocliConfig.get_quant_method: MocliMoEMethod's moe
    R(MOE, "RoutedExperts.expert_map", ATTRIBUTE),  # MocliMoEMethod._check_placement and apply
    R(MOE, "RoutedExperts.activation", ATTRIBUTE),  # MocliMoEMethod.create_weights: silu (read with a default)
    R(MOE, "RoutedExperts.apply_router_weight_on_input", ATTRIBUTE),  # MocliMoEMethod.create_weights: False
    R(MOE, "RoutedExperts.quant_method", ATTRIBUTE),  # loader._converted_layers
    R(LOADER, "register_model_loader", FUNCTION, ("load_format",)),  # engine.register_all: load format "mocli"
    R(BASE, "BaseModelLoader", CLASS, implements=("download_model", "load_weights")),  # MocliModelLoader's base
    R(BASE, "BaseModelLoader.download_model", METHOD, ("model_config",), override=True),  # MocliModelLoader
    R(BASE, "BaseModelLoader.load_weights", METHOD, ("model", "model_config"), override=True),  # MocliModelLoader
    R(BASE, "BaseModelLoader.load_config", ATTRIBUTE),  # MocliModelLoader: .download_dir
    R("vllm.logger", "init_logger", FUNCTION, ("name",)),  # loader, methods: loggers under "vllm"
    R("vllm.distributed", "get_tensor_model_parallel_rank", FUNCTION, ()),  # MocliConfig.rank
    R("vllm.engine.arg_utils", "EngineArgs.create_engine_config", METHOD, patched=True),  # engine: wrapped
    R("vllm.engine.arg_utils", "EngineArgs.model", ATTRIBUTE),  # engine.create_engine_config: precheck a directory
    R("vllm.engine.arg_utils", "EngineArgs.revision", ATTRIBUTE),  # engine.create_engine_config: with a default
    R("vllm.engine.arg_utils", "EngineArgs.kv_cache_dtype", ATTRIBUTE),  # engine.prepare: auto, or asked for
    R(CONFIG, "VllmConfig.model_config", ATTRIBUTE),  # engine.create_engine_config and prepare
    R(CONFIG, "VllmConfig.load_config", ATTRIBUTE),  # engine.prepare: the load format
    R(CONFIG, "VllmConfig.quant_config", ATTRIBUTE),  # engine.prepare: MocliConfig, manifest read
    R(CONFIG, "VllmConfig.parallel_config", ATTRIBUTE),  # engine.prepare: checked against the layout
    R(CONFIG, "VllmConfig.cache_config", ATTRIBUTE),  # engine.prepare: an NVFP4 KV cache on the CPU refused
    R(CONFIG, "CacheConfig.cache_dtype", ATTRIBUTE),  # engine._check_kv_cache (set to bfloat16 there), _log_rules
    R(CONFIG, "VllmConfig.device_config", ATTRIBUTE),  # engine._check_kv_cache
    R(CONFIG, "DeviceConfig.device_type", ATTRIBUTE),  # engine._check_kv_cache: "cpu" on vLLM's CPU build
    R(CONFIG, "ModelConfig.quantization", ATTRIBUTE),  # engine.create_engine_config: "mocli"?
    R(CONFIG, "ModelConfig.model", ATTRIBUTE),  # engine.prepare, MocliModelLoader: the directory or repo id
    R(CONFIG, "ModelConfig.revision", ATTRIBUTE),  # MocliModelLoader: the Hub revision
    R(CONFIG, "LoadConfig.load_format", ATTRIBUTE),  # engine.prepare: read, then set to "mocli"
    R(CONFIG, "LoadConfig.download_dir", ATTRIBUTE),  # MocliModelLoader: the Hub cache
    R(CONFIG, "ParallelConfig.tensor_parallel_size", ATTRIBUTE),  # engine.prepare
    R(CONFIG, "ParallelConfig.pipeline_parallel_size", ATTRIBUTE),  # engine.prepare: must be 1
    R(CONFIG, "ParallelConfig.data_parallel_size", ATTRIBUTE),  # engine.prepare: must be 1
    R(CONFIG, "ParallelConfig.enable_expert_parallel", ATTRIBUTE),  # engine.prepare
    R(TORCH_UTILS, "", MODULE),  # engine._patch_kv_cache_dtype: imported as a module
    # engine._patch_kv_cache_dtype: vLLM calls the wrapper, the wrapper the original
    R(TORCH_UTILS, "get_kv_cache_quant_algo_string", FUNCTION, ("quant_cfg",), override=True, patched=True,
      fallback="--kv-cache-dtype auto stays BF16: pass --kv-cache-dtype fp8 (or nvfp4) as the source declares"),
    # serve.marlin on CUDA: the marlin target's stored bytes straight into vLLM's Marlin kernels
    R(MARLIN_FP4, "apply_fp4_marlin_linear", FUNCTION, ("input", "weight", "weight_scale", "weight_global_scale",
                                                        "workspace", "size_n", "size_k", "bias"), fallback=DECODED),
    R(MARLIN_UTILS, "marlin_make_workspace_new", FUNCTION, ("device",), fallback=DECODED),
    R(f"{MOE}.experts.marlin_moe", "fused_marlin_moe", FUNCTION, (
        "hidden_states", "w1", "w2", "bias1", "bias2", "w1_scale", "w2_scale", "topk_weights", "topk_ids",
        "quant_type_id"), kwargs_ok=True, fallback=DECODED),
    R("vllm.scalar_type", "scalar_types.float4_e2m1f", ATTRIBUTE, fallback=DECODED),
)


def param_problems(req: Requirement, sig: Sequence[tuple[str, str, bool]]) -> list[str]:
    """``sig``: (name, inspect.Parameter kind name, required) per parameter, self/cls left out."""
    named = [n for n, kind, _ in sig if kind not in VARIADIC]
    want = req.params or ()
    absorbed = req.kwargs_ok and not req.override and any(kind == "VAR_KEYWORD" for _, kind, _ in sig)
    out = [f"{req.path}: parameter {p} missing" for p in want if p not in named and not absorbed]
    if req.override:
        out += [f"{req.path}: unexpected parameter {n}" for n in named if n not in want and not req.kwargs_ok]
    else:
        out += [f"{req.path}: parameter {n} is required" for n, kind, required in sig if required and n not in want]
    present = [p for p in want if p in named]
    if not out and not req.kwargs_ok and named[:len(present)] != present:
        out.append(f"{req.path}: parameters ({', '.join(named)}) do not start with ({', '.join(present)})")
    return out


def abstract_problems(req: Requirement, abstract: set[str]) -> list[str]:
    return [f"{req.path}: abstract method {m} is not implemented" for m in sorted(abstract - set(req.implements))]


def probe(import_module: Callable, requirements: Sequence[Requirement] = REQUIREMENTS) -> list[str]:
    """This vLLM's problems, found by importing it (``importlib.import_module``); [] when it has everything."""
    return [problem for req in requirements for problem in _probe(req, import_module)]


def probe_split(import_module: Callable) -> tuple[list[str], list[tuple[Requirement, list[str]]]]:
    """(problems the plugin cannot work around, (requirement, problems) of those it has a fallback for)."""
    hard = probe(import_module, [r for r in REQUIREMENTS if not r.fallback])
    soft = [(r, found) for r in REQUIREMENTS if r.fallback and (found := _probe(r, import_module))]
    return hard, soft


_MISSING = object()
_IS_KIND = {CLASS: inspect.isclass, FUNCTION: callable, METHOD: callable, DICT: lambda o: isinstance(o, dict)}


def _probe(req: Requirement, import_module: Callable) -> list[str]:
    try:
        obj = import_module(req.module)
    except Exception as e:  # noqa: BLE001 - a module that fails to import is a finding
        return [f"{req.module}: cannot import ({type(e).__name__}: {e})"]
    owner, where = None, req.module
    for part in filter(None, req.name.split(".")):
        owner, obj = obj, getattr(obj, part, _MISSING)
        if obj is _MISSING:
            found = req.kind == ATTRIBUTE and isinstance(owner, type) and _instance_attribute(owner, part)
            return [] if found else [f"{where}: no attribute {part}"]
        where = f"{where}.{part}"
    if req.kind in _IS_KIND and not _IS_KIND[req.kind](obj):
        return [f"{req.path}: not a {req.kind}"]
    out = abstract_problems(req, set(getattr(obj, "__abstractmethods__", ()))) if req.implements else []
    if req.params is not None:
        params = list(inspect.signature(obj).parameters.values())
        raw = inspect.getattr_static(owner, req.name.rsplit(".", 1)[-1]) if req.kind == METHOD else None
        if req.kind == METHOD and not isinstance(raw, staticmethod | classmethod):
            params = params[1:]  # self: the function was read off the class
        out += param_problems(req, [(p.name, p.kind.name, p.default is p.empty and p.kind.name not in VARIADIC)
                                    for p in params])
    return out


def _instance_attribute(cls: type, name: str) -> bool:
    """Annotated (a dataclass field) in the class or a base, or set on ``self`` in their source."""
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return True
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):  # no source (a builtin, a frozen or compiled-only module)
            continue
    return False
