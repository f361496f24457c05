"""Quantization method ``mocli``: which vLLM layer gets which method, from the layout manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

from mocli.errors import MocliError
from mocli.formats.layout import MANIFEST_NAME, QUANT_METHOD, read_layout, shared_fields
from mocli.formats.manifest import Layout, ModuleEntry, TensorInfo
from mocli.kinds import KINDS, ModuleKind
from mocli.vllm_plugin.checks import LayoutMismatch, read_quantization_config


def model_dir(model: str, revision: str | None = None, download_dir: str | None = None,
              only: list[str] | None = None) -> Path:
    """A local directory as given; a Hub repo id through the Hugging Face cache (HF_HUB_OFFLINE honoured),
    ``only`` these files when given."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=only))


class MocliConfig(QuantizationConfig):
    """config.json ``quantization_config`` of a ``mocli convert`` output, plus its manifest as a ``Layout``
    (the one ``precheck`` read, taken by ``maybe_update_config`` in the first process; it reaches the
    engine core and the workers pickled inside vLLM's config)."""

    def __init__(self, quantization_config: dict[str, Any]) -> None:
        super().__init__()
        self.qc = quantization_config
        self.target, self.parallel = read_quantization_config(quantization_config)
        self.model_dir: str | None = None
        self.layout: Layout | None = None
        self._by_prefix: dict[str, ModuleEntry] | None = None
        self._rename = None  # the model's checkpoint -> vLLM module renames

    # --- what vLLM asks every quantization config ----------------------------------------------------

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MocliConfig:
        return cls(config)

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]  # what the FlashInfer kernels, and mocli.serve, produce

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # BF16; FP8 tensor cores (89+) and NVFP4 ones (100+) are chosen per module, else emulated

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything is in config.json

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Read the layout manifest beside config.json and check that both describe the same layout."""
        from mocli.vllm_plugin.precheck import layout_read

        directory = model_dir(model_name, revision, only=["config.json", MANIFEST_NAME])
        try:
            layout = layout_read(directory) or read_layout(directory)
        except MocliError as e:
            raise LayoutMismatch(f"{e.message}" + (f" ({e.hint})" if e.hint else "")) from None
        said = shared_fields(layout)
        for key in ("layout_version", "target", "parallel"):
            if said[key] != self.qc.get(key):
                raise LayoutMismatch(f"{directory}: config.json says {key} {self.qc.get(key)!r} but the manifest "
                                     f"says {said[key]!r}; the directory is damaged, convert again")
        self.model_dir, self.layout = str(directory), layout

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self._rename, self._by_prefix = hf_to_vllm_mapper, None

    # --- layers ---------------------------------------------------------------------------------------

    def rank(self) -> int | None:
        """This process's layout rank: vLLM's tensor-parallel rank (dp = 1), None for a one-rank layout."""
        if self.layout is None or not self.layout.ranks:
            return None
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def rank_modules(self) -> tuple[tuple[ModuleEntry, ...], dict[str, TensorInfo]]:
        """(modules, tensors) of this process's rank, as the manifest lists them."""
        _, modules, tensors = self.read_layout().view(self.rank())
        return modules, tensors

    def read_layout(self) -> Layout:
        if self.layout is None:
            raise LayoutMismatch("the layout manifest was not read (vLLM did not call maybe_update_config)")
        return self.layout

    def module_for(self, prefix: str) -> ModuleEntry | None:
        """The manifest module a vLLM layer prefix holds (names renamed as the model renames them)."""
        if self._by_prefix is None:
            modules, _ = self.rank_modules()
            by = {}
            for m in modules:
                vllm_name = self._rename.map_name(m.name) if self._rename is not None else None
                by[vllm_name or m.name] = m
            self._by_prefix = by
        return self._by_prefix.get(prefix)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from mocli.vllm_plugin.methods import MocliLinearMethod, MocliMoEMethod

        # KV-cache scales load as vLLM's ModelOpt path loads them (ModelOptKVCacheMethod is this class)
        if isinstance(layer, Attention | MLAAttention):
            return BaseKVCacheMethod(self)
        entry = self.module_for(prefix)
        moe = entry is not None and KINDS[ModuleKind(entry.kind)].moe
        if isinstance(layer, LinearBase):
            if entry is None:
                return UnquantizedLinearMethod()
            if moe:
                raise LayoutMismatch(f"{prefix}: the layout holds a {entry.kind} module here, vLLM a linear layer")
            return MocliLinearMethod(self, entry)
        if isinstance(layer, RoutedExperts):
            if entry is None:
                return None  # vLLM's unquantized experts (an excluded MoE layer)
            if not moe:
                raise LayoutMismatch(f"{prefix}: the layout holds a {entry.kind} module here, vLLM an MoE layer")
            return MocliMoEMethod(self, entry, layer.moe_config)
        if entry is not None:
            raise LayoutMismatch(f"{prefix}: the layout holds a {entry.kind} module here, vLLM a "
                                 f"{type(layer).__name__}, which mocli's plugin does not know how to run")
        return None

    def tensor_info(self, name: str) -> TensorInfo:
        """The manifest's dtype/shape of one of this rank's tensors."""
        described = self.read_layout().described(self.rank())
        if name in described:
            return described[name]
        raise LayoutMismatch(f"the manifest names tensor {name} in a module but does not describe it; convert again")
