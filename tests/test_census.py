"""Census of modules: counts hand-derived from the real exports' configs."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.generate import make_checkpoint
from mocli.census import _PROJ, Kind, _match_expert, build_census
from mocli.checkpoint import open_checkpoint
from mocli.io.safetensors_file import TensorEntry
from mocli.quant_config import Algo
from mocli.schemes import COMPRESSED_TENSORS, FP8, FP8_BLOCK, FP8_CHANNEL, MXFP8, NVFP4
from mocli.tables import EXPERT_NAMINGS
from tests.conftest import REAL, REAL_LLAMA, REAL_QWEN


def test_real_qwen3_moe():
    c = build_census(open_checkpoint(REAL_QWEN).tensors)
    # config.json: 2 layers, 8 experts, moe_intermediate 128, hidden 256
    assert [m.name for m in c.moe] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(m.num_experts == 8 and m.intermediate == 128 and m.hidden == 256 for m in c.moe)
    assert all(m.naming.style == "qwen" and m.schemes == {NVFP4} for m in c.moe)
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
    assert c.moe == [] and all(m.scheme is FP8 for m in c.linears())


def test_mixtral_naming_and_schemes(tmp_path):
    c = build_census(open_checkpoint(make_checkpoint(tmp_path / "m", arch="mixtral", algo="FP8")).tensors)
    layer = c.moe[0]
    assert layer.naming.style == "mixtral" and layer.name == "model.layers.0.block_sparse_moe.experts"
    e0 = layer.experts[0]
    assert e0.gate.name.endswith("experts.0.w1") and e0.up.name.endswith(".w3") and e0.down.name.endswith(".w2")


def test_scheme_detection_per_algorithm(tmp_path):
    for algo, scheme in ((Algo.FP8_PER_CHANNEL_PER_TOKEN, FP8_CHANNEL), (Algo.FP8_PB_WO, FP8_BLOCK)):
        c = build_census(open_checkpoint(make_checkpoint(tmp_path / algo, algo=str(algo))).tensors)
        assert {m.scheme for m in c.linears()} == {scheme} and scheme.algo is algo


def test_real_mxfp8_export_is_not_read_as_fp8_blocks():
    """ModelOpt 0.47's MXFP8: an e4m3 weight with U8 E8M0 scales [N, K/32] (it was misfiled as FP8_PB_WO)."""
    c = build_census(open_checkpoint(REAL / "llama-mxfp8").tensors)
    assert {m.scheme for m in c.linears() if m.scheme} == {MXFP8}
    assert c.modules["model.layers.0.mlp.down_proj"].tensors["weight_scale"].shape == (256, 512 // 32)


def _entries(tmp_path, spec: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, TensorEntry]:
    return {n: TensorEntry(n, tmp_path, d, s, 0, 0) for n, (d, s) in spec.items()}


def test_one_valued_fp8_scales_are_per_tensor(tmp_path):
    """llm-compressor's static FP8 stores the weight scale [1]-shaped in BF16 (it was misfiled as per-channel)."""
    c = build_census(_entries(tmp_path, {"m.o_proj.weight": ("F8_E4M3", (64, 32)),
                                         "m.o_proj.weight_scale": ("BF16", (1,)),
                                         "m.down_proj.weight": ("F8_E4M3", (64, 32)),
                                         "m.down_proj.weight_scale": ("BF16", (64, 1))}))
    assert c.modules["m.o_proj"].scheme is FP8 and c.modules["m.down_proj"].scheme is FP8_CHANNEL


def test_a_second_spelling_binds_canonical_roles(tmp_path):
    """compressed-tensors' names for the NVFP4 tensors (SEMANTICS §17.1) land on the same roles."""
    spec = {"m.q_proj.weight_packed": ("U8", (64, 16)), "m.q_proj.weight_scale": ("F8_E4M3", (64, 2)),
            "m.q_proj.weight_global_scale": ("F32", (1,)), "m.q_proj.input_global_scale": ("F32", (1,))}
    m = build_census(_entries(tmp_path, spec), COMPRESSED_TENSORS).modules["m.q_proj"]
    assert m.scheme is NVFP4 and m.out_in == (64, 32)
    assert {r: e.name.rpartition(".")[2] for r, e in m.tensors.items()} == {
        "weight": "weight_packed", "weight_scale": "weight_scale", "weight_scale_2": "weight_global_scale",
        "input_scale": "input_global_scale"}


def test_lone_shard_is_a_plain_linear(tmp_path):
    from mocli.io.safetensors_file import TensorEntry
    e = TensorEntry("x.mlp.gate_proj.weight", tmp_path, "BF16", (4, 4), 0, 32)
    c = build_census({e.name: e})
    assert c.fused == [] and c.modules["x.mlp.gate_proj"].kind is Kind.LINEAR


def test_paused_gc_freezes_only_for_the_program(monkeypatch):
    """The collector is paused inside and back on after; what was built is frozen only where the mocli
    program owns the process (bulk.FREEZE, set by mocli.cli.main), never for a library caller."""
    import gc

    from mocli.io import bulk

    assert gc.isenabled()
    before = gc.get_freeze_count()
    with bulk.paused_gc():
        assert not gc.isenabled()
        keep = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == before
    monkeypatch.setattr(bulk, "FREEZE", True)
    try:
        with bulk.paused_gc():
            keep += [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= before + 1000
    finally:
        gc.unfreeze()
    assert keep


# The regexes _match_expert once ran (one per naming), kept here as the reference its string methods answer to
_EXPERT_RE = {n.style: re.compile(rf"^(?P<layer>.*\.{re.escape(n.container)})\.(?P<e>\d+)\.(?P<proj>[^.]+)$")
              for n in EXPERT_NAMINGS}


def _by_regex(name: str):
    for naming in EXPERT_NAMINGS:
        m = _EXPERT_RE[naming.style].match(name)
        if m is not None and (slot := _PROJ[naming.style].get(m.group("proj"))) is not None:
            return naming, m.group("layer"), int(m.group("e")), slot
    return None


_PARTS = ["model", "layers", "0", "12", "mlp", "experts", "block_sparse_moe", "gate_proj", "up_proj", "w1", "w3",
          "down_proj", "gate_up_proj", "-", "", "٣", "²", "7\n", "\n", "x\ny", "experts\n"]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_PARTS), min_size=1, max_size=7))
def test_match_expert_is_the_regex(parts):
    name = ".".join(parts)
    assert _match_expert(name) == _by_regex(name)


def test_match_expert_tricky_names():
    cases = {"model.layers.3.mlp.experts.17.up_proj": ("qwen", "model.layers.3.mlp.experts", 17, "up"),
             ".mlp.experts.0.gate_proj": ("qwen", ".mlp.experts", 0, "gate"),
             "x.block_sparse_moe.experts.2.w3": ("mixtral", "x.block_sparse_moe.experts", 2, "up"),
             "x.mlp.experts.٣.down_proj": ("qwen", "x.mlp.experts", 3, "down"),  # \d takes any decimal digit
             "mlp.experts.0.gate_proj": None, "x.mlp.experts.².gate_proj": None, "x.mlp.experts.1.w1": None,
             "x\n.mlp.experts.0.gate_proj": None, "x.mlp.experts.0.gate_proj\n": None, "x.mlp.experts.0.": None}
    for name, want in cases.items():
        got = _match_expert(name)
        assert (got and (got[0].style, *got[1:])) == want, name
        assert got == _by_regex(name), name
