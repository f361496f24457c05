"""vLLM quantize methods for converted modules: parameters with exactly the layout's per-rank names,
dtypes and shapes; no math after loading; ``apply`` runs ``mocli.serve``."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearMethodBase

from mocli import serve
from mocli.formats.manifest import ModuleEntry
from mocli.io.safetensors_file import torch_dtypes
from mocli.kinds import ModuleKind
from mocli.targets import layout_of
from mocli.vllm_plugin.checks import LayoutMismatch

logger = init_logger(f"vllm.{__name__}")  # under "vllm": shown in vLLM's log
_announced: set[tuple[str, str]] = set()

# The kernels run behind two opaque custom ops: torch.compile (vLLM's default on CPU and CUDA) must not
# trace into them (the emulated MoE groups tokens by expert with data-dependent shapes, and the caches
# are filled on first use). A kernel is found by its method's key, as vLLM finds layers by name; the
# layer's method holds it, so it goes (caches included) when the model goes.
_KERNELS: weakref.WeakValueDictionary[str, serve.Kernel] = weakref.WeakValueDictionary()


@torch.library.custom_op("mocli::linear", mutates_args=())
def _linear_op(x: torch.Tensor, key: str, bias: torch.Tensor | None) -> torch.Tensor:
    return _KERNELS[key](x, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, key: str, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _KERNELS[key].n))


@torch.library.custom_op("mocli::moe", mutates_args=())
def _moe_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: str,
            expert_map: torch.Tensor | None) -> torch.Tensor:
    return _KERNELS[key](x, topk_weights, topk_ids, expert_map)


@_moe_op.register_fake
def _(x, topk_weights, topk_ids, key, expert_map) -> torch.Tensor:
    return x.new_empty((x.shape[0], _KERNELS[key].hidden))


def _announce(kernel: serve.Kernel, device: torch.device) -> None:
    """One log line per kind and path, so the log says where emulation runs."""
    key = (str(kernel.kind), kernel.path)
    if key not in _announced:
        _announced.add(key)
        how = ("emulated: mocli decodes the layout on first use and caches it; BF16/FP32 GEMMs" if kernel.emulated
               else "tensor-core kernel")
        logger.info("mocli: %s modules run %s on %s (%s)", kernel.kind, kernel.path, device, how)


def _refuse_loader(param: torch.nn.Parameter, *args: Any, **kwargs: Any) -> None:
    """Converted tensors are copied by mocli's model loader only; vLLM's sharding loaders would re-slice them."""
    raise LayoutMismatch(f"{getattr(param, 'mocli_name', 'a converted tensor')} reached vLLM's weight loader; "
                         "serve a mocli directory with its own load format (omit --load-format)")


class _LayoutParams:
    """Registers a module's layout tensors as parameters of the layer, one per role."""

    def __init__(self, config, entry: ModuleEntry) -> None:
        self.config, self.entry = config, entry
        self.name: str = entry.name
        self.kernel: serve.Kernel | None = None

    def roles(self) -> dict[str, str]:
        """role -> tensor name; the bias goes into the layer's own ``bias`` parameter."""
        return {r: t for r, t in self.entry.tensors.items() if r != "bias"}

    def register(self, layer: torch.nn.Module, params_dtype: torch.dtype) -> None:
        """One parameter per role, dtype and shape from the manifest, checked against the module's sizes and
        the activation dtype its scales were written for (Marlin's: ``act_dtype``; fp16 and bf16 give other bytes)."""
        act = self.entry.meta.get("act_dtype")
        if act is not None and str(params_dtype).removeprefix("torch.") != act:
            raise LayoutMismatch(f"{self.name}: converted for {act} activations (Marlin's scales depend on it), vLLM "
                                 f"builds this layer in {str(params_dtype).removeprefix('torch.')}; serve with --dtype {act}")
        dtypes = torch_dtypes()
        shapes = {}
        for role, tname in self.roles().items():
            info = self.config.tensor_info(tname)
            shapes[role] = (dtypes[info.dtype], info.shape)
        try:
            serve.KERNELS[ModuleKind(self.entry.kind)].check(shapes, self.entry.meta, layout_of(self.config.target),
                                                                self.name)
        except serve.ServeError as e:
            raise LayoutMismatch(f"{e}; the manifest is damaged, convert again") from None
        for role, tname in self.roles().items():
            self._param(layer, role, tname, *shapes[role])
        self._stored_bias(layer, dtypes)

    def _param(self, layer: torch.nn.Module, role: str, tname: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        p.weight_loader = _refuse_loader
        p.mocli_name = tname
        layer.register_parameter(role, p)

    def _stored_bias(self, layer: torch.nn.Module, dtypes: dict) -> None:
        """A layout that stores the bias in its kernel's form (marlin: padded to Np and permuted) gets a
        parameter of that shape in place of vLLM's [N] one; the layer still hands it to ``apply``."""
        tname = self.entry.tensors.get("bias")
        bias = getattr(layer, "bias", None)
        if tname is None or not isinstance(bias, torch.nn.Parameter):
            return
        info = self.config.tensor_info(tname)
        if info.shape != tuple(bias.shape):
            self._param(layer, "bias", tname, dtypes[info.dtype], info.shape)

    @property
    def key(self) -> str:
        return f"{self.name}@{id(self)}"  # unique per engine, should two share a process

    def build(self, layer: torch.nn.Module) -> None:
        """The serving kernel over the loaded parameters: references only, nothing computed."""
        tensors = {role: getattr(layer, role) for role in self.roles()}
        self.kernel = serve.kernel(self.entry.kind, tensors, self.entry.meta, self.config.target, self.name)
        _KERNELS[self.key] = self.kernel
        _announce(self.kernel, next(iter(tensors.values())).device)


class MocliLinearMethod(LinearMethodBase):
    """A converted dense linear (fp8_linear, fp8_channel_linear, fp8_block_linear, nvfp4_linear)."""

    supports_pre_processed_weights = True

    def __init__(self, config, entry: ModuleEntry) -> None:
        self.params = _LayoutParams(config, entry)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        meta = self.params.entry.meta
        n, k = sum(output_partition_sizes), input_size_per_partition
        if (n, k) != (meta["n"], meta["k"]):
            raise LayoutMismatch(f"{self.params.name}: vLLM builds this rank's layer as [{n}, {k}], the layout holds "
                                 f"[{meta['n']}, {meta['k']}] (converted for another parallel layout or model)")
        self.params.register(layer, params_dtype)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.params.build(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear_op(x, self.params.key, bias)


class MocliMoEMethod(FusedMoEMethodBase):
    """A converted MoE layer (fp8_moe, nvfp4_moe). Modular: the engine routes, this runs the experts of
    this rank and returns their unreduced sum."""

    supports_pre_processed_weights = True

    def __init__(self, config, entry: ModuleEntry, moe) -> None:
        super().__init__(moe)
        self.params = _LayoutParams(config, entry)

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        meta, name = self.params.entry.meta, self.params.name
        built = (num_experts, intermediate_size_per_partition, hidden_size)
        stored = (meta["experts"], meta["intermediate"], meta["hidden"])
        if built != stored:
            raise LayoutMismatch(f"{name}: vLLM builds this rank's experts as (experts, I, H) = {built}, the layout "
                                 f"holds {stored} (converted for another parallel layout or model)")
        # the layout's activation (meta, default silu): gpt-oss's MXFP4 experts store swigluoai (SEMANTICS §19.2)
        activation, stored_act = getattr(getattr(layer, "activation", None), "value", "silu"), meta.get("activation", "silu")
        if str(activation).lower() != stored_act or getattr(layer, "apply_router_weight_on_input", False):
            raise LayoutMismatch(f"{name}: mocli's MoE kernel computes {stored_act}(gate, up) with router weights on "
                                 f"the output; this layer uses {activation} / weights on the input")
        self.params.register(layer, params_dtype)

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        return hidden_size, intermediate_size_per_partition  # the layout is stored unpadded

    def get_fused_moe_quant_config(self, layer):
        return None  # mocli.serve runs the experts, not vLLM's modular kernels

    def process_weights_after_loading(self, layer) -> None:
        self._check_placement(layer)
        self.params.build(layer)

    def _check_placement(self, layer) -> None:
        """vLLM's expert map must give this rank the layout's experts (linear placement, SEMANTICS §10)."""
        emap = getattr(layer, "expert_map", None)
        if emap is None:
            return
        meta = self.params.entry.meta
        off, e = int(meta.get("expert_offset", 0)), int(meta["experts"])
        want = torch.full((emap.numel(),), -1, dtype=torch.long)
        want[off:off + e] = torch.arange(e)
        if not torch.equal(emap.detach().cpu().long(), want):
            raise LayoutMismatch(f"{self.params.name}: vLLM places experts {_held(emap)} on this rank, the layout "
                                 f"holds {off}..{off + e - 1}; serve with the default (linear) expert placement")

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return _moe_op(x, topk_weights, topk_ids, self.params.key, layer.expert_map)


def _held(emap: torch.Tensor) -> str:
    ids = (emap >= 0).nonzero().reshape(-1).tolist()
    return f"{ids[0]}..{ids[-1]}" if ids else "none"
