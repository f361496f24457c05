"""inspect on a DeepSeek-R1-sized tensor census (~90,000 tensors, tiny shapes), 8 shards.

Prints seconds and the ratio to the 2-second target (ratio <= 1.0 meets it).
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET_S = 2.0
LAYERS, EXPERTS, SHARDS = 58, 128, 8


def _write_shard(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    header, off = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(off))


def make_big(root: Path) -> int:
    """NVFP4 MoE with 58 layers x 128 experts: weight, weight_scale, weight_scale_2, input_scale each."""
    h, i = 64, 64
    names: dict[str, tuple[str, list[int], int]] = {}

    def nvfp4(m: str, n: int, k: int) -> None:
        names[m + ".weight"] = ("U8", [n, k // 2], n * k // 2)
        names[m + ".weight_scale"] = ("F8_E4M3", [n, k // 16], n * k // 16)
        names[m + ".weight_scale_2"] = ("F32", [], 4)
        names[m + ".input_scale"] = ("F32", [], 4)

    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            nvfp4(p + "self_attn." + proj, h, h)
        names[p + "mlp.gate.weight"] = ("BF16", [EXPERTS, h], EXPERTS * h * 2)
        names[p + "input_layernorm.weight"] = ("BF16", [h], h * 2)
        for e in range(EXPERTS):
            for proj, (n, k) in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                nvfp4(f"{p}mlp.experts.{e}.{proj}", n, k)
    keys = sorted(names)
    per = -(-len(keys) // SHARDS)
    weight_map = {}
    for s in range(SHARDS):
        fname = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {k: names[k] for k in keys[s * per:(s + 1) * per]}
        _write_shard(root / fname, part)
        weight_map |= {k: fname for k in part}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    (root / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": q}))
    (root / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    return len(names)


def main() -> None:
    from mocli.checkpoint import open_checkpoint
    from mocli.inspection import inspect_checkpoint

    with tempfile.TemporaryDirectory() as d:
        n = make_big(Path(d))
        t0 = time.perf_counter()
        info = inspect_checkpoint(open_checkpoint(d))
        dt = time.perf_counter() - t0
        assert info["num_tensors"] == n and len(info["moe_layers"]) == LAYERS
        print(f"inspect: {n} tensors in {SHARDS} shards: {dt:.2f} s; ratio to {TARGET_S:.0f} s target: "
              f"{dt / TARGET_S:.2f}")


if __name__ == "__main__":
    main()
