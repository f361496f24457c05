"""make_big.py's NVFP4 MoE respelled as a compressed-tensors ``mxfp4-pack-quantized`` checkpoint of the same
size class, shard by shard, for the bench (untimed): each expert's packed e2m1 ``weight`` [N, K/2] kept as
``weight_packed``, its FP8 [N, K/16] scales replaced by random but valid E8M0 [N, K/32] ``weight_scale``
(U8 in 118..135, never 255), ``weight_scale_2`` / ``input_scale`` dropped. Attention linears become random
BF16 ``weight`` [N, K] and are listed in ``ignore`` (flashinfer-trtllm takes no MXFP4 linears), so both
``marlin`` and ``flashinfer-trtllm`` convert it. ``quantization_config`` as llm-compressor writes it
(fixtures/real/qwen3_moe-ct-mxfp4/config.json).

    python tests/bench/to_mxfp4.py SRC OUT
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MX = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
      "scale_dtype": "torch.uint8", "zp_dtype": None, "actorder": None, "block_structure": None,
      "observer_kwargs": {}}


def one_shard(t: dict, g: torch.Generator) -> tuple[dict, set[str]]:
    quantized = {n.rpartition(".")[0] for n in t if n.endswith(".weight_scale_2")}
    new, dense = {}, set()
    for name, v in t.items():
        module, _, suffix = name.rpartition(".")
        if module not in quantized:
            new[name] = v
        elif ".mlp.experts." not in module:  # attention: BF16, ignored
            if suffix == "weight":
                new[name] = torch.randn(v.shape[0], v.shape[1] * 2, generator=g).mul_(0.02).to(torch.bfloat16)
                dense.add(module)
        elif suffix == "weight":
            new[f"{module}.weight_packed"] = v
        elif suffix == "weight_scale":
            n, k16 = v.shape
            new[name] = torch.randint(118, 136, (n, k16 // 2), dtype=torch.uint8, generator=g)
    return new, dense


def respell(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map, ignore, total = {}, [], 0
    for shard in sorted(set(index["weight_map"].values())):
        new, dense = one_shard(load_file(str(src / shard)), g)
        save_file(new, str(out / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(new, shard)
        ignore += sorted(dense)
        total += sum(v.numel() * v.element_size() for v in new.values())
        del new
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    hq = json.loads((src / "hf_quant_config.json").read_text())["quantization"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "version": "0.19.0",
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized", "targets": ["Linear"], "output_activations": None,
            "weights": {**MX, "dynamic": False, "observer": "memoryless_minmax"},
            "input_activations": {**MX, "dynamic": True, "observer": None}}},
        "ignore": hq["exclude_modules"] + ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "hf_quant_config.json",
                                                         "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    respell(Path(sys.argv[1]), Path(sys.argv[2]))
