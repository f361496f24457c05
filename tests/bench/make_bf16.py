"""An unquantized (BF16) MoE checkpoint for the quantize benchmark: random weights, one shard per layer.

    python tests/bench/make_bf16.py OUT [--layers 4] [--experts 32] [--hidden 4096] [--inter 1536]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_bf16(out: Path, layers: int = 4, experts: int = 32, hidden: int = 4096, inter: int = 1536) -> None:
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    files = [f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors" for i in range(layers + 1)]

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * 0.02).bfloat16()

    head = {"model.embed_tokens.weight": w(1024, hidden), "lm_head.weight": w(1024, hidden),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    save_file(head, str(out / files[0]), metadata={"format": "pt"})
    weight_map |= {k: files[0] for k in head}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "mlp.gate.weight": w(experts, hidden)}
        for name, n in (("q_proj", hidden), ("k_proj", hidden // 4), ("v_proj", hidden // 4), ("o_proj", hidden)):
            t[p + f"self_attn.{name}.weight"] = w(n, hidden)
        for e in range(experts):
            for name, n, k in (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)):
                t[p + f"mlp.experts.{e}.{name}.weight"] = w(n, k)
        save_file(t, str(out / files[layer + 1]), metadata={"format": "pt"})
        weight_map |= {k: files[layer + 1] for k in t}
        del t
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": hidden // 32,
        "num_experts": experts, "num_experts_per_tok": 8, "moe_intermediate_size": inter}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=1536)
    a = ap.parse_args()
    make_bf16(a.out, a.layers, a.experts, a.hidden, a.inter)
