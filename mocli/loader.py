"""Public API: load a converted directory into per-module objects holding what a FlashInfer call needs.

    from mocli.loader import load_converted
    ck = load_converted("out/", device="cuda")
    moe = ck.modules["model.layers.0.mlp.experts"]          # Nvfp4MoE
    cutlass_fused_moe(..., quant_scales=moe.cutlass_quant_scales(), ...)

The layout contract is ``mocli/docs/LAYOUT.md`` (layout_version 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from mocli.checkpoint import INDEX_NAME
from mocli.errors import CorruptFileError, InputError
from mocli.io.safetensors_file import TensorReader, read_header
from mocli.plan import LAYOUT_VERSION, MANIFEST_NAME


@dataclass
class Fp8Linear:
    """FP8 per-tensor: y = (x_fp8 @ weight.T) * weight_scale * input_scale, x_fp8 = fp8(x / input_scale)."""

    name: str
    weight: torch.Tensor  # F8 [N, K]
    weight_scale: torch.Tensor  # F32 []
    input_scale: torch.Tensor  # F32 []
    n: int
    k: int
    shard_rows: list[int]


@dataclass
class Fp8ChannelLinear:
    """FP8 per-channel weights, dynamic per-token activations."""

    name: str
    weight: torch.Tensor  # F8 [N, K]
    weight_scale: torch.Tensor  # F32 [N]
    n: int
    k: int
    shard_rows: list[int]


@dataclass
class Fp8BlockLinear:
    """FP8 128x128 block weight-only; activations dynamic per 1x128 group."""

    name: str
    weight: torch.Tensor  # F8 [N, K]
    weight_scale: torch.Tensor  # F32 [N/128, K/128]
    n: int
    k: int
    shard_rows: list[int]


@dataclass
class Nvfp4Linear:
    """NVFP4: mm_fp4(fp4_quantize(x, input_scale_inv), weight, weight_scale, alpha). Target-specific layout."""

    name: str
    weight: torch.Tensor  # U8 [padded_n, padded_k/2] (cutlass) or shuffled [N, K/2] (trtllm)
    weight_scale: torch.Tensor  # F8 [roundup(N,128), roundup(K/16,4)], 128x4 interleaved
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor
    alpha: torch.Tensor  # input_scale * weight_scale_2
    input_scale_inv: torch.Tensor  # 1 / input_scale, what fp4_quantize takes
    n: int
    k: int
    shard_rows: list[int]
    padded_n: int
    padded_k: int


@dataclass
class Fp8MoE:
    """FP8 per-tensor experts; w13 rows are [w3; w1] per expert (trtllm: also reordered + shuffled)."""

    name: str
    w13_weight: torch.Tensor  # F8 [E, 2I, H]
    w2_weight: torch.Tensor  # F8 [E, H, I]
    w13_weight_scale: torch.Tensor  # [E]
    w2_weight_scale: torch.Tensor  # [E]
    w13_input_scale: torch.Tensor  # [] a1
    w2_input_scale: torch.Tensor  # [] a2
    w13_input_scale_inv: torch.Tensor
    w2_input_scale_inv: torch.Tensor
    g1_alphas: torch.Tensor  # [E]
    g2_alphas: torch.Tensor  # [E]
    experts: int
    intermediate: int
    hidden: int
    naming: str
    output1_scales_scalar: torch.Tensor | None = None
    output1_scales_gate_scalar: torch.Tensor | None = None
    output2_scales_scalar: torch.Tensor | None = None

    def cutlass_quant_scales(self) -> list[torch.Tensor]:
        """FlashInfer cutlass_fused_moe FP8 quant_scales (SEMANTICS §4, §9): a1 folded into g1_alphas."""
        return [self.g1_alphas, self.w2_input_scale_inv, self.g2_alphas, self.w13_input_scale]


@dataclass
class Nvfp4MoE:
    """NVFP4 experts; w13 rows [w3; w1]; block scales 128x4 interleaved per expert."""

    name: str
    w13_weight: torch.Tensor  # U8 [E, 2I, H/2]
    w13_weight_scale: torch.Tensor  # F8 [E, roundup(2I,128), roundup(H/16,4)]
    w13_weight_scale_2: torch.Tensor  # [E]
    w13_input_scale: torch.Tensor  # [E]
    w2_weight: torch.Tensor  # U8 [E, H, I/2]
    w2_weight_scale: torch.Tensor  # F8 [E, roundup(H,128), roundup(I/16,4)]
    w2_weight_scale_2: torch.Tensor  # [E]
    w2_input_scale: torch.Tensor  # [E]
    g1_alphas: torch.Tensor
    g2_alphas: torch.Tensor
    a1_gscale: torch.Tensor
    a2_gscale: torch.Tensor
    experts: int
    intermediate: int
    hidden: int
    naming: str
    output1_scale_scalar: torch.Tensor | None = None
    output1_scale_gate_scalar: torch.Tensor | None = None
    output2_scale_scalar: torch.Tensor | None = None

    def cutlass_quant_scales(self) -> list[torch.Tensor]:
        """FlashInfer cutlass_fused_moe NVFP4 quant_scales (SEMANTICS §7.5)."""
        return [self.a1_gscale, self.w13_weight_scale.view(torch.int32), self.g1_alphas,
                self.a2_gscale, self.w2_weight_scale.view(torch.int32), self.g2_alphas]


KINDS: dict[str, type] = {
    "fp8_linear": Fp8Linear, "fp8_channel_linear": Fp8ChannelLinear, "fp8_block_linear": Fp8BlockLinear,
    "nvfp4_linear": Nvfp4Linear, "fp8_moe": Fp8MoE, "nvfp4_moe": Nvfp4MoE,
}
ConvertedModule = Fp8Linear | Fp8ChannelLinear | Fp8BlockLinear | Nvfp4Linear | Fp8MoE | Nvfp4MoE


@dataclass
class ConvertedCheckpoint:
    path: Path
    manifest: dict[str, Any]
    modules: dict[str, ConvertedModule]
    _reader: TensorReader
    _entries: dict

    @property
    def target(self) -> str:
        return self.manifest["target"]

    @property
    def provenance(self) -> dict[str, Any]:
        return self.manifest.get("provenance", {})

    def module_info(self, name: str) -> dict[str, Any]:
        return next(m for m in self.manifest["modules"] if m["name"] == name)

    def tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Any output tensor by name (pass-through tensors included)."""
        if name not in self._entries:
            raise KeyError(name)
        return self._reader.read(self._entries[name]).to(device)

    def load_module(self, name: str, device: str | torch.device = "cpu") -> ConvertedModule:
        """Build one module object from its manifest entry, tensors on ``device``."""
        m = self.module_info(name)
        cls = KINDS[m["kind"]]
        names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {"name": name}
        for role, tname in m["tensors"].items():
            if role in names:
                if tname not in self._entries:
                    raise CorruptFileError(f"{self.path}: manifest names tensor '{tname}' that no shard holds")
                kwargs[role] = self.tensor(tname, device)
        kwargs |= {k: v for k, v in m["meta"].items() if k in names}
        return cls(**kwargs)

    def close(self) -> None:
        self._reader.close()


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = Path(path) / MANIFEST_NAME
    if not mpath.exists():
        raise InputError(f"{path}: no {MANIFEST_NAME}; not a mocli-converted checkpoint",
                         hint="run mocli convert first")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{mpath}: invalid JSON ({e})") from None
    if manifest.get("format") != "mocli-layout":
        raise CorruptFileError(f"{mpath}: not a mocli layout manifest")
    if manifest.get("layout_version") != LAYOUT_VERSION:
        raise InputError(f"{mpath}: layout_version {manifest.get('layout_version')} is not supported "
                         f"(this mocli reads {LAYOUT_VERSION})", hint="convert again with this mocli version")
    return manifest


def load_converted(path: str | Path, device: str | torch.device = "cpu",
                   modules: list[str] | None = None) -> ConvertedCheckpoint:
    """Read the manifest and the tensors of every (or the named; [] for none) module onto ``device``."""
    path = Path(path)
    manifest = read_manifest(path)
    index_path = path / INDEX_NAME
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptFileError(f"{index_path}: unreadable index ({e})") from None
    entries: dict = {}
    for fname in sorted(set(weight_map.values())):
        entries |= read_header(path / fname).tensors
    ck = ConvertedCheckpoint(path, manifest, {}, TensorReader(), entries)
    wanted = [m["name"] for m in manifest["modules"]] if modules is None else modules
    for name in wanted:
        ck.modules[name] = ck.load_module(name, device)
    return ck
