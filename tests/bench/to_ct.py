"""A ModelOpt NVFP4 checkpoint (the shared make_big.py's) respelled as compressed-tensors, shard by shard: what
compressed-tensors 0.20's ModelOpt converter writes (SEMANTICS §17.6): ``weight`` -> ``weight_packed``,
``weight_scale_2`` / ``input_scale`` -> their float32 reciprocals ``weight_global_scale`` /
``input_global_scale`` [1], ``config.json`` ``quantization_config`` in compressed-tensors' form, no
hf_quant_config.json. For the bench (untimed); the tests use the converter's real outputs.

    python tests/bench/to_ct.py SRC OUT
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

RENAME = {"weight_scale_2": "weight_global_scale", "input_scale": "input_global_scale"}


def respell(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        t = load_file(str(src / shard))
        quantized = {n.rpartition(".")[0] for n in t if n.endswith(".weight_scale_2")}
        new = {}
        for name, v in t.items():
            module, _, suffix = name.rpartition(".")
            if module in quantized and suffix in RENAME:
                new[f"{module}.{RENAME[suffix]}"] = torch.reciprocal(v.float()).reshape(1)
            elif module in quantized and suffix == "weight":
                new[f"{module}.weight_packed"] = v
            else:
                new[name] = v
        save_file(new, str(out / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(new, shard)
        del t, new
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": index["metadata"], "weight_map": weight_map}))
    hq = json.loads((src / "hf_quant_config.json").read_text())["quantization"]
    nvfp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "version": "0.20.0",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**nvfp4, "dynamic": False},
                                      "input_activations": {**nvfp4, "dynamic": "local"}}},
        "ignore": hq["exclude_modules"], "quantization_status": "compressed"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.suffix not in (".safetensors",) and f.name not in ("config.json", "hf_quant_config.json",
                                                                 "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    respell(Path(sys.argv[1]), Path(sys.argv[2]))
