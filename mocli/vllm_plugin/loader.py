"""Load format ``mocli``: each rank copies its own tensors into place and proves nothing is missing.

Converted modules are copied byte for byte into the parameters their methods created (same name,
dtype and shape, or one error naming the difference). Everything else of the rank (embeddings,
norms, routers, lm_head, excluded BF16 layers under their source names, KV-cache scales) goes
through the model's own ``load_weights``, so vLLM shards and stacks it as it does for any
checkpoint. Then both directions are checked: every parameter of the model was filled (converted
layers by the copies, the others by vLLM's loaders; only KV-cache scales may be absent, as for any
checkpoint), and every tensor of the rank was taken by a parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from mocli.errors import MocliError
from mocli.formats.layout import rank_entries
from mocli.formats.manifest import ModuleEntry
from mocli.io.safetensors_file import torch_dtypes
from mocli.loader import shard_into
from mocli.vllm_plugin.checks import LayoutMismatch
from mocli.vllm_plugin.config import MocliConfig, model_dir
from mocli.vllm_plugin.methods import MocliLinearMethod, MocliMoEMethod

logger = init_logger(f"vllm.{__name__}")  # under "vllm": shown in vLLM's log


KV_SCALE_NAMES = (".k_scale", ".v_scale")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


class MocliModelLoader(BaseModelLoader):
    def download_model(self, model_config) -> None:
        model_dir(model_config.model, model_config.revision, self.load_config.download_dir)

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        config = _mocli_config(model)
        directory = model_dir(model_config.model, model_config.revision, self.load_config.download_dir)
        rank = config.rank()
        layers = _converted_layers(model)
        modules, _ = config.rank_modules()
        targets = _copy_targets(modules, layers)  # every check that needs no bytes, before reading any
        try:
            entries = rank_entries(directory, config.read_layout(), rank)
        except MocliError as e:
            raise LayoutMismatch(e.message + (f" ({e.hint})" if e.hint else "")) from None
        _check_index(config, entries, rank)
        dtypes = torch_dtypes()
        for name, param in targets.items():
            if name in entries:
                _check_same(name, dtypes[entries[name].dtype], tuple(entries[name].shape), param)
        device = next(iter(layers.values())).weight_device if layers else next(model.parameters()).device
        # the converted tensors are read straight into their parameters, the rest handed to vLLM's loaders
        direct = {n: p.data for n, p in targets.items() if p.data.is_contiguous() and p.device == device}
        feed = _Passthrough(model)
        for tensors in shard_into(entries.values(), direct, device):
            for name, t in tensors.items():
                if name in targets:
                    targets[name].data.copy_(t)
                else:
                    feed(name, t)
        feed.check()
        _check_filled(model, layers, feed.params)
        logger.info("mocli: rank %s loaded %d converted and %d pass-through tensors from %s", rank or 0,
                    len(targets), feed.count, directory)


class _Layer:
    def __init__(self, qualname: str, module: torch.nn.Module, method) -> None:
        self.qualname, self.module, self.method = qualname, module, method

    @property
    def weight_device(self) -> torch.device:
        return next(self.module.parameters()).device


def _mocli_config(model: torch.nn.Module) -> MocliConfig:
    for m in model.modules():
        qc = getattr(m, "quant_config", None)
        if isinstance(qc, MocliConfig):
            return qc
    raise LayoutMismatch("the model was built without mocli's quantization config; load format 'mocli' only "
                         "reads directories written by mocli convert")


def _converted_layers(model: torch.nn.Module) -> dict[str, _Layer]:
    """manifest module name -> the vLLM layer whose quant method runs it."""
    out = {}
    for qualname, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, MocliLinearMethod | MocliMoEMethod):
            out[method.params.name] = _Layer(qualname, m, method)
    return out


def _check_index(config: MocliConfig, entries: dict[str, Any], rank: int | None) -> None:
    """The rank's shards hold exactly the tensors the manifest lists, with its dtypes and shapes."""
    listed = config.read_layout().described(rank)
    where = f"{config.model_dir} (rank {rank or 0})"
    missing = sorted(set(listed) - set(entries))
    if missing:
        raise LayoutMismatch(f"{where}: tensor {_few(missing)} is in the manifest but in no shard; convert again")
    extra = sorted(set(entries) - set(listed))
    if extra:
        raise LayoutMismatch(f"{where}: tensor {_few(extra)} is in the shards but not in the manifest; convert again")
    for name, e in entries.items():
        want = listed[name]
        if e.dtype != want.dtype or tuple(e.shape) != want.shape:
            raise LayoutMismatch(f"{where}: tensor {name} is {e.dtype} {list(e.shape)} in its shard, "
                                 f"{want.dtype} {list(want.shape)} in the manifest; convert again")


def _copy_targets(modules: tuple[ModuleEntry, ...], layers: dict[str, _Layer]) -> dict[str, torch.nn.Parameter]:
    """tensor name -> the parameter it is copied into, for every converted module of the rank; both sides
    complete (every module has its layer, every layer its module, every parameter of those layers a
    tensor)."""
    absent = [m.name for m in modules if m.name not in layers]
    if absent:
        raise LayoutMismatch(f"the layout's module {_few(absent)} has no layer in vLLM's model (another architecture "
                             "or vLLM naming); convert from the checkpoint this model was built from")
    stray = sorted(set(layers) - {m.name for m in modules})
    if stray:
        raise LayoutMismatch(f"vLLM gave mocli's method to {_few(stray)}, which the layout does not hold")
    targets = {}
    for m in modules:
        layer = layers[m.name].module
        for role, tname in m.tensors.items():
            param = getattr(layer, role, None)
            if not isinstance(param, torch.nn.Parameter):
                raise LayoutMismatch(f"{m.name}: the layout has {role} ({tname}) but vLLM's layer has no such "
                                     "parameter (a bias the model does not expect?)")
            targets[tname] = param
        unfilled = sorted(n for n, _ in layer.named_parameters(recurse=False) if n not in m.tensors)
        if unfilled:
            raise LayoutMismatch(f"{m.name}: vLLM's layer has {', '.join(unfilled)}, which the layout does not "
                                 "hold (the source had no such tensor?)")
    return targets


def _check_same(name: str, dtype: torch.dtype, shape: tuple[int, ...], param: torch.nn.Parameter) -> None:
    """A stored tensor goes byte for byte into the parameter of the same name: same dtype and shape, or one
    error naming both sides (checked before any byte is read)."""
    if param.dtype != dtype or tuple(param.shape) != shape:
        names = {v: k for k, v in torch_dtypes().items()}
        raise LayoutMismatch(f"{name}: the layout stores {names.get(dtype, dtype)} {list(shape)}, vLLM's layer "
                             f"expects {names.get(param.dtype, param.dtype)} {list(param.shape)}")


class _Passthrough:
    """Feeds each pass-through tensor to the model's own loader and requires that it landed somewhere.
    One call per tensor: AutoWeightsLoader drops some names silently (ignored suffixes), and the set it
    returns is the only way to tell which."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tied = tied_aliases(model)  # e.g. lm_head.weight when tied: vLLM loads the embedding once
        # vLLM keeps KV-cache scales in parameters of the model dtype (BF16) and casts the stored float32
        # on copy, with a warning per tensor that reads like an error; the same cast done here first
        # gives the same bits (round to nearest even either way) and no warning.
        self.kv_dtype = next((p.dtype for n, p in model.named_parameters() if n.endswith(KV_SCALE_NAMES)), None)
        self.params: set[str] | None = set()  # vLLM's qualified names loaded (None: the model does not say)
        self.dropped: list[str] = []
        self.count = 0

    def __call__(self, name: str, t: torch.Tensor) -> None:
        self.count += 1
        if name in self.tied:
            return
        if self.kv_dtype is not None and name.endswith(KV_SCALE_NAMES):
            t = t.to(self.kv_dtype)
        loaded = self.model.load_weights([(name, t)])
        if loaded is None or self.params is None:
            self.params = None
        elif loaded:
            self.params |= loaded
        else:
            self.dropped.append(name)

    def check(self) -> None:
        if self.dropped:
            raise LayoutMismatch(f"vLLM's model took no parameter for {_few(sorted(self.dropped))}; this directory "
                                 "does not match the architecture vLLM built from its config.json")


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that aliases another's tensor (a tied lm_head: vLLM loads the embedding once) ->
    the first name of that tensor. What vLLM's private ``_get_tied_embedding_params`` gives for embeddings,
    written here over every parameter so the plugin does not depend on it."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if (seen := first.setdefault(id(param), name)) != name:
            aliases[name] = seen
    return aliases


def _check_filled(model: torch.nn.Module, layers: dict[str, _Layer], loaded: set[str] | None) -> None:
    """Every parameter holds checkpoint data: vLLM's strict check for unquantized models (default_loader
    ``track_weights_loading``), with converted layers counted as filled by their copies."""
    if loaded is None:
        return
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    filled, converted = set(loaded), {id(layer.module) for layer in layers.values()}
    for qualname, module in model.named_modules():
        exempt = isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod)  # optional KV-cache scales
        if exempt or id(module) in converted:
            filled |= {f"{qualname}.{n}" if qualname else n for n, _ in module.named_parameters(recurse=False)}
    missing = sorted({n for n, _ in model.named_parameters()} - filled)
    if missing:
        raise LayoutMismatch(f"vLLM's model has {_few(missing)}, which this directory does not hold (its source "
                             "lacked them); vLLM would leave them uninitialized")
