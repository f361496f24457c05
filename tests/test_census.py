"""Census of modules: counts hand-derived from the real exports' configs."""

from __future__ import annotations

from fixtures.generate import make_checkpoint
from mocli.census import Kind, build_census
from mocli.checkpoint import open_checkpoint
from mocli.quant_config import Algo
from tests.conftest import REAL_LLAMA, REAL_QWEN


def test_real_qwen3_moe():
    c = build_census(open_checkpoint(REAL_QWEN).tensors)
    # config.json: 2 layers, 8 experts, moe_intermediate 128, hidden 256
    assert [m.name for m in c.moe] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(m.num_experts == 8 and m.intermediate == 128 and m.hidden == 256 for m in c.moe)
    assert all(m.naming.style == "qwen" and m.schemes == {Algo.NVFP4} for m in c.moe)
    assert [g.fused for g in c.fused] == ["qkv_proj", "qkv_proj"]
    assert len(c.kv_scales) == 4 and c.num_layers == 2
    assert c.modules["model.layers.0.mlp.gate"].kind is Kind.LINEAR
    assert c.modules["model.layers.0.mlp.gate"].scheme is None
    assert c.modules["lm_head"].kind is Kind.EMBEDDING
    assert c.modules["model.layers.0.self_attn.o_proj"].out_in == (256, 256)  # K unpacked from U8 [256,128]


def test_real_llama_fused_groups():
    c = build_census(open_checkpoint(REAL_LLAMA).tensors)
    groups = {g.name: [m.name.rpartition(".")[2] for m in g.shards] for g in c.fused}
    assert groups["model.layers.1.self_attn.qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert groups["model.layers.1.mlp.gate_up_proj"] == ["gate_proj", "up_proj"]
    assert c.moe == [] and all(m.scheme is Algo.FP8 for m in c.linears())


def test_mixtral_naming_and_schemes(tmp_path):
    c = build_census(open_checkpoint(make_checkpoint(tmp_path / "m", arch="mixtral", algo="FP8")).tensors)
    layer = c.moe[0]
    assert layer.naming.style == "mixtral" and layer.name == "model.layers.0.block_sparse_moe.experts"
    e0 = layer.experts[0]
    assert e0.gate.name.endswith("experts.0.w1") and e0.up.name.endswith(".w3") and e0.down.name.endswith(".w2")


def test_scheme_detection_per_algorithm(tmp_path):
    for algo in (Algo.FP8_PER_CHANNEL_PER_TOKEN, Algo.FP8_PB_WO):
        c = build_census(open_checkpoint(make_checkpoint(tmp_path / algo, algo=str(algo))).tensors)
        assert {m.scheme for m in c.linears()} == {algo}


def test_lone_shard_is_a_plain_linear(tmp_path):
    from mocli.io.safetensors_file import TensorEntry
    e = TensorEntry("x.mlp.gate_proj.weight", tmp_path, "BF16", (4, 4), 0, 32)
    c = build_census({e.name: e})
    assert c.fused == [] and c.modules["x.mlp.gate_proj"].kind is Kind.LINEAR
