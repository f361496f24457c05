"""Damaged copies of converted directories: one function per way a directory can lie about itself.

Shared by the verify tests (tests/test_layout_audit.py: verify fails every one) and the engine tests
(tests/test_vllm.py: mocli's plugin refuses every one with a single ``mocli:`` line). Each function
edits a fresh copy in place; ``DAMAGES`` names the source fixture, the target it is converted for, and
words both refusals must contain.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mocli.io.digests import DIGEST, file_digest

O_PROJ = "model.layers.0.self_attn.o_proj.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def _manifest(out: Path) -> dict:
    return json.loads((out / "mocli-layout.json").read_text())


def _save_manifest(out: Path, m: dict) -> None:
    (out / "mocli-layout.json").write_text(json.dumps(m, indent=2))


def _qc(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def _save_config(out: Path, cfg: dict, record: bool) -> None:
    """config.json rewritten; ``record``: the manifest's digest of it updated too (a consistent lie)."""
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if record:
        m = _manifest(out)
        m["files"]["config.json"] = {"size": (out / "config.json").stat().st_size,
                                     DIGEST: file_digest(out / "config.json")}
        _save_manifest(out, m)


def manifest_shape(out: Path) -> None:
    """o_proj.weight's manifest shape [256, 256] -> [256, 128] (the shard keeps [256, 256])."""
    m = _manifest(out)
    m["tensors"][O_PROJ]["shape"] = [256, 128]
    _save_manifest(out, m)


def manifest_transposed(out: Path) -> None:
    """qkv_proj.weight [512, 256] -> [256, 512]: the same element count."""
    m = _manifest(out)
    m["tensors"][QKV]["shape"] = m["tensors"][QKV]["shape"][::-1]
    _save_manifest(out, m)


def manifest_dtype(out: Path) -> None:
    m = _manifest(out)
    m["tensors"][O_PROJ]["dtype"] = "U8"
    _save_manifest(out, m)


def unknown_target(out: Path) -> None:
    """Both files name a target this mocli does not know, consistently."""
    m = _manifest(out)
    m["target"] = "tensorrt-llm"
    _save_manifest(out, m)
    cfg = _qc(out)
    cfg["quantization_config"]["target"] = "tensorrt-llm"
    _save_config(out, cfg, record=True)


def relabelled_as(target: str) -> Callable[[Path], None]:
    """An output relabelled ``target`` in config.json and the manifest, the manifest's digest of config.json
    updated: every record agrees; the kinds, roles and transforms do not."""
    def edit(out: Path) -> None:
        m = _manifest(out)
        m["target"] = target
        _save_manifest(out, m)
        cfg = _qc(out)
        cfg["quantization_config"]["target"] = target
        _save_config(out, cfg, record=True)
    return edit


relabelled_target = relabelled_as("flashinfer-trtllm")  # a flashinfer-cutlass output


def config_edited(out: Path) -> None:
    """config.json's target changed after conversion, the manifest untouched."""
    cfg = _qc(out)
    cfg["quantization_config"]["target"] = "flashinfer-trtllm"
    _save_config(out, cfg, record=False)


def kind_lie(out: Path) -> None:
    """A dense module's kind said to be an MoE one."""
    m = _manifest(out)
    mod = next(x for x in m["modules"] if x["name"].endswith("o_proj"))
    mod["kind"] = "fp8_moe"
    _save_manifest(out, m)


def undescribed_tensor(out: Path) -> None:
    """A module names a tensor the manifest's tensors{} does not describe."""
    m = _manifest(out)
    mod = next(x for x in m["modules"] if x["name"].endswith("o_proj"))
    mod["tensors"]["weight"] = O_PROJ + "_gone"
    _save_manifest(out, m)


def layout_v1(out: Path) -> None:
    """The directory as layout_version 1 wrote it: the source's own config files (quant_method
    modelopt) with mocli's provenance inside, files{} recording the shards only."""
    m = _manifest(out)
    cfg = _qc(out)
    qc = cfg["quantization_config"]
    cfg["quantization_config"] = {**qc["source_quantization_config"], "mocli": qc["mocli"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if qc.get("source_hf_quant_config"):
        (out / "hf_quant_config.json").write_text(json.dumps({**qc["source_hf_quant_config"], "mocli": qc["mocli"]}))
    m["layout_version"] = 1
    m["files"] = {k: v for k, v in m["files"].items() if k.endswith(".safetensors")}
    _save_manifest(out, m)


@dataclass(frozen=True)
class Damage:
    edit: Callable[[Path], None]
    source: str  # "llama-fp8" (the real FP8 Llama) or "qwen3moe-nvfp4" (the real NVFP4 Qwen3-MoE)
    target: str
    says: str  # in verify's finding and in the plugin's refusal
    exit_code: int = 1  # verify's


CUTLASS, TRTLLM, MARLIN = "flashinfer-cutlass", "flashinfer-trtllm", "marlin"
DAMAGES: dict[str, Damage] = {
    "manifest-shape": Damage(manifest_shape, "llama-fp8", CUTLASS, f"{O_PROJ}: F8_E4M3 [256, 256] in its shard, "
                             "F8_E4M3 [256, 128] in the manifest"),
    "manifest-transposed": Damage(manifest_transposed, "llama-fp8", CUTLASS, f"{QKV}: F8_E4M3 [512, 256] in its shard"),
    "manifest-dtype": Damage(manifest_dtype, "llama-fp8", CUTLASS, f"{O_PROJ}: F8_E4M3 [256, 256] in its shard, U8"),
    "unknown-target": Damage(unknown_target, "llama-fp8", CUTLASS, "target 'tensorrt-llm' is not one this mocli knows",
                             exit_code=2),
    "relabelled-target": Damage(relabelled_target, "qwen3moe-nvfp4", CUTLASS, "not those of flashinfer-trtllm"),
    "config-edited": Damage(config_edited, "llama-fp8", CUTLASS, "config.json differs from the xxh3_128 digest"),
    "kind-lie": Damage(kind_lie, "llama-fp8", CUTLASS, "model.layers.0.self_attn.o_proj: a fp8_moe module"),
    "undescribed-tensor": Damage(undescribed_tensor, "llama-fp8", CUTLASS,
                                 f"names tensor {O_PROJ}_gone (weight), which the manifest does not describe"),
    "layout-v1": Damage(layout_v1, "llama-fp8", CUTLASS, "layout_version 1"),
    # the marlin layout's shapes are its own, but a relabelled one must be named before any shape is read
    "marlin-as-cutlass": Damage(relabelled_as(CUTLASS), "qwen3moe-nvfp4", MARLIN,
                                "flashinfer-cutlass writes no nvfp4_marlin_linear module"),
    "cutlass-as-marlin": Damage(relabelled_as(MARLIN), "qwen3moe-nvfp4", CUTLASS, "marlin writes no nvfp4_linear module"),
}
