"""MXFP4 read side (issue 46 item 2): every real MXFP4 export through inspect and validate, and planted faults.

Expected schemes, counts and findings come from the fixtures' README (fixtures/real/README.md, "MXFP4
checkpoints"), i.e. from what each tool wrote, and from SEMANTICS §19 (what vLLM 0.33 reads or refuses); the
per-expert bytes of gpt-oss's 4-D tensors are compared with the safetensors library's own reading.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import REAL, edit_tensor

# folder -> (MXFP4 modules by kind, MoE layers' (experts, I, H, gate_up rows)) from the README's table:
# Llama-style 2 layers x 7 projections; Qwen3-MoE 8 experts x 3 projections + attention; the tiny gpt-oss has
# 4 experts, I = H = 256, attention quantized by every tool except the native layout (attention BF16)
LLAMA = {"linear": 4, "fused shard": 10}
QWEN = {"linear": 2, "fused shard": 6, "expert": 48}
GPT_OSS_ATTN = {"linear": 2, "fused shard": 6}
EXPECT = {
    "llama-ct-mxfp4": (LLAMA, None),
    "llama-ct-mxfp4a16": (LLAMA, None),
    "llama-ct-mxfp4a16-model_free": (LLAMA | {"embedding/lm_head": 1}, None),
    "llama-quark-mxfp4": (LLAMA, None),
    "llama-mxfp4": (LLAMA, None),
    "llama-w4a8_mxfp4_fp8": (LLAMA, None),
    "qwen3_moe-ct-mxfp4": (QWEN, (8, 128, 256, "halves")),
    "qwen3_moe-ct-mxfp4a16": (QWEN, (8, 128, 256, "halves")),
    "qwen3_moe-quark-mxfp4": (QWEN, (8, 128, 256, "halves")),
    "qwen3_moe-mxfp4": (QWEN, (8, 128, 256, "halves")),
    "gpt_oss-ct-mxfp4a16": (GPT_OSS_ATTN | {"expert": 24}, (4, 256, 256, "halves")),
    "gpt_oss-quark-mxfp4": (GPT_OSS_ATTN | {"expert": 16}, (4, 256, 256, "interleaved")),
    "gpt_oss-mxfp4": ({"expert": 16}, (4, 256, 256, "interleaved")),
    "gpt_oss-modelopt-mxfp4": (GPT_OSS_ATTN, None),
    # the broken model_free export: gate/up cut from transformers' [E, H, 2I] as if [E, out, in]
    "gpt_oss-ct-mxfp4a16-model_free": (GPT_OSS_ATTN | {"expert": 24, "embedding/lm_head": 1}, (4, 128, 512, "halves")),
}
# folder -> error codes validate (vLLM's reading) must report, and nothing else
ERRORS = {
    "llama-ct-mxfp4a16-model_free": {"TNS008"},  # model.embed_tokens quantized
    "gpt_oss-ct-mxfp4a16-model_free": {"TNS008", "TNS006"},  # and experts that do not chain
    "llama-mxfp4": {"VLL002"},  # vLLM 0.33 refuses ModelOpt's "mxfp4" (SEMANTICS §19.2)
    "qwen3_moe-mxfp4": {"VLL002"},
    "gpt_oss-modelopt-mxfp4": {"VLL002", "TNS009"},  # and experts blocked along the output features
    "llama-w4a8_mxfp4_fp8": {"CFG003"},  # W4A8_MXFP4_FP8 is not an algorithm mocli reads (its group_size not judged)
}
FOLDERS = sorted(p.name for p in REAL.iterdir() if p.is_dir() and "mxfp4" in p.name)


def test_every_mxfp4_folder_is_covered():
    assert sorted(EXPECT) == FOLDERS


@pytest.mark.parametrize("name", FOLDERS)
def test_inspect_reads_mxfp4(cli, name):
    r = cli("--json", "inspect", REAL / name)
    assert r.exit_code == 0, r.stderr
    info = r.json
    kinds, moe = EXPECT[name]
    assert info["stored_schemes"] == ["MXFP4"]
    assert {row["kind"]: row["MXFP4"] for row in info["modules"] if "MXFP4" in row} == kinds
    assert "NVFP4" not in json.dumps(info["modules"])
    if moe is None:
        assert info["moe_layers"] == []
    else:
        assert [(m["experts"], m["intermediate"], m["hidden"], m["gate_up"], m["schemes"]) for m in info["moe_layers"]] \
            == [(*moe, ["MXFP4"])] * 2


@pytest.mark.parametrize("name", FOLDERS)
def test_validate_mxfp4(cli, name):
    r = cli("--json", "validate", REAL / name)
    errors = {f["code"] for f in r.json["findings"] if f["severity"] == "error"}
    assert errors == ERRORS.get(name, set()), r.json["findings"]
    assert r.exit_code == (1 if errors else 0)


def test_the_broken_exports_name_what_is_wrong(cli):
    found = cli("--json", "validate", REAL / "gpt_oss-modelopt-mxfp4").json["findings"]
    blocked = sorted(f["location"] for f in found if f["code"] == "TNS009")
    assert blocked == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    found = cli("--json", "validate", REAL / "gpt_oss-ct-mxfp4a16-model_free").json["findings"]
    chain = [f for f in found if f["code"] == "TNS006"]
    # gate_proj [128, 256] bytes = [128, 512] logical; down_proj [256, 256]: I and H swapped in halves
    assert {f["location"] for f in chain} == {"model.layers.0.mlp.experts.0", "model.layers.1.mlp.experts.0"}
    assert "gate [128, 512] and down [256, 256]" in chain[0]["message"]
    embed = [f for f in found if f["code"] == "TNS008"]
    assert [f["location"] for f in embed] == ["model.embed_tokens"]


@pytest.mark.parametrize("name", ["gpt_oss-mxfp4", "gpt_oss-quark-mxfp4", "llama-quark-mxfp4", "llama-mxfp4"])
def test_sglang_is_not_judged_on_mxfp4(cli, name):
    d = cli("--json", "validate", REAL / name, "--engine", "sglang").json
    assert d["verdict"] == "not judged"
    assert [n["name"] for n in d["not_judged"] if n["what"] == "engine"] == ["sglang"]
    assert not any(f["code"].startswith("SGL") for f in d["findings"])


def test_gpt_oss_experts_are_read_per_expert_from_their_own_bytes():
    """The census's per-expert entries of the 4-D tensors are the bytes safetensors gives for expert e."""
    from mocli.checkpoint import open_checkpoint

    d = REAL / "gpt_oss-mxfp4"
    census = open_checkpoint(d).census()
    stored = load_file(str(d / "model.safetensors"))
    layer = next(m for m in census.moe if m.name == "model.layers.1.mlp.experts")
    with open(d / "model.safetensors", "rb") as f:
        raw = f.read()
    for e, ex in layer.experts.items():
        assert ex.gate is None and ex.up is None
        for mod, proj in ((ex.gate_up, "gate_up_proj"), (ex.down, "down_proj")):
            for suffix, name, view in (("weight", "_blocks", lambda t: t.reshape(t.shape[0], -1)),
                                       ("weight_scale", "_scales", lambda t: t), ("bias", "_bias", lambda t: t)):
                entry = mod.tensors[suffix]
                want = view(stored[f"{layer.name}.{proj}{name}"][e]).contiguous()
                assert entry.name == f"{layer.name}.{proj}{name}"
                assert tuple(entry.shape) == tuple(want.shape)
                assert raw[entry.start:entry.start + entry.nbytes] == want.reshape(-1).view(torch.uint8).numpy().tobytes()


def _drop(d, name):
    f = d / "model.safetensors"
    t = load_file(str(f))
    del t[name]
    save_file(t, str(f), metadata={"format": "pt"})


def _codes(cli, d, *args):
    r = cli("--json", "validate", d, *args)
    return r, [(f["code"], f["location"]) for f in r.json["findings"]]


def test_e8m0_code_255_is_nan_under_deep(cli, real_copy):
    d = real_copy("llama-ct-mxfp4")
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    edit_tensor(d, name, lambda t: t.index_put_((torch.tensor([3]), torch.tensor([2])), torch.tensor(255, dtype=torch.uint8)))
    r, codes = _codes(cli, d)
    assert r.exit_code == 0 and codes == []  # headers alone cannot see it
    r, codes = _codes(cli, d, "--deep")
    assert r.exit_code == 1 and codes == [("DAT001", name)]
    assert "0xFF" in r.json["findings"][0]["message"]


def test_e8m0_code_255_in_gpt_oss_scales(cli, real_copy):
    d = real_copy("gpt_oss-mxfp4")
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    edit_tensor(d, name, lambda t: t.index_put_((torch.tensor([2]), torch.tensor([5]), torch.tensor([3])),
                                                 torch.tensor(255, dtype=torch.uint8)))
    r, codes = _codes(cli, d, "--deep")
    assert codes == [("DAT001", name)]


def test_k_not_a_multiple_of_32(cli, real_copy):
    d = real_copy("llama-quark-mxfp4")
    m = "model.layers.0.self_attn.o_proj"
    edit_tensor(d, f"{m}.weight", lambda t: t[:, :120])  # K = 240 = 7.5 blocks
    edit_tensor(d, f"{m}.weight_scale", lambda t: t[:, :8])
    r, codes = _codes(cli, d)
    assert r.exit_code == 1 and codes == [("TNS003", f"{m}.weight")]
    assert "[256, 240]" in r.json["findings"][0]["message"]


def test_a_missing_scales_tensor_is_named(cli, real_copy):
    d = real_copy("gpt_oss-mxfp4")
    _drop(d, "model.layers.1.mlp.experts.down_proj_scales")
    r, codes = _codes(cli, d)
    assert r.exit_code == 1
    assert ("TNS001", "model.layers.1.mlp.experts.down_proj_blocks") in codes
    assert "down_proj_scales" in next(f["message"] for f in r.json["findings"] if f["code"] == "TNS001")


def test_a_truncated_blocks_tensor_is_named(cli, real_copy):
    d = real_copy("gpt_oss-mxfp4")
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    edit_tensor(d, name, lambda t: t[:, :, :6])  # 6 of the 8 blocks per row left, the scales still say 8
    r, codes = _codes(cli, d)
    assert r.exit_code == 1 and ("TNS003", name) in codes
    edit_tensor(d, name, lambda t: t[..., :8])  # 8-byte blocks
    r, codes = _codes(cli, d)
    assert ("TNS003", name) in codes
    assert "16" in next(f["message"] for f in r.json["findings"] if f["location"] == name)


def test_a_file_cut_short_is_an_input_error(cli, real_copy):
    d = real_copy("gpt_oss-mxfp4")
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size - 4096)
    r = cli("validate", d)
    assert r.exit_code in (1, 2) and "Traceback" not in r.stderr
    assert "model.safetensors" in r.stderr


def test_tensor_parallel_splits_follow_each_loader(cli):
    """gpt-oss's loaders split I in whole 32-blocks, unequally; every other spelling equally, so at tp 16
    (I / tp = 16) only the split-gate/up export cannot hold whole scale blocks (SEMANTICS §19.3)."""
    par = Counter(c for c, loc in _codes(cli, REAL / "gpt_oss-ct-mxfp4a16", "--tp", "16")[1] if loc.endswith("experts"))
    assert par == {"PAR003": 2}
    for name in ("gpt_oss-mxfp4", "gpt_oss-quark-mxfp4"):
        par = [c for c, loc in _codes(cli, REAL / name, "--tp", "16")[1] if loc.endswith("experts")]
        assert par == [], name
        par = [c for c, loc in _codes(cli, REAL / name, "--tp", "3")[1] if loc.endswith("experts")]
        assert par == ["PAR003", "PAR003"], name  # vLLM asserts I % tp == 0
    assert [c for c, _ in _codes(cli, REAL / "gpt_oss-mxfp4", "--tp", "2", "--ep", "8")[1]] == ["PAR002", "PAR002"]


@pytest.mark.parametrize("target,serves", [("flashinfer-trtllm", "--target marlin"),  # its MXFP4 linears
                                           ("flashinfer-cutlass", "--target flashinfer-trtllm")])  # its experts
def test_convert_refuses_mxfp4(cli, tmp_path, target, serves):
    """A target without a path for some MXFP4 layer refuses the whole conversion, naming one that serves it."""
    out = tmp_path / "out"
    r = cli("convert", REAL / "qwen3_moe-ct-mxfp4a16", "-o", out, "--target", target)
    assert r.exit_code == 1 and "TGT002" in r.stderr
    assert serves in cli("validate", REAL / "qwen3_moe-ct-mxfp4a16", "--target", target).stdout
    assert not out.exists()


def _with_quant(real_copy, name, edit):
    d = real_copy(name)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_quark_schemes_other_than_mxfp4_are_named(cli, real_copy):
    d = _with_quant(real_copy, "llama-quark-mxfp4", lambda q: q["global_quant_config"]["weight"].update(dtype="int4"))
    r, codes = _codes(cli, d)
    assert ("CFG003", "config.json: quantization_config: global_quant_config") in codes
    assert "'int4'" in r.json["findings"][0]["message"]
    fp8_in = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}
    d = _with_quant(real_copy, "qwen3_moe-quark-mxfp4",
                    lambda q: q["global_quant_config"].update(input_tensors=fp8_in))
    assert ("CFG003", "config.json: quantization_config: global_quant_config") in _codes(cli, d)[1]


def test_quark_exclude_matches_as_vllm_does(cli, real_copy):
    """exclude entries are exact names or re: patterns (quark/utils.py :: should_ignore_layer); dropping the
    routers' entries leaves BF16 routers the config now declares quantized."""
    d = _with_quant(real_copy, "gpt_oss-quark-mxfp4", lambda q: q.update(exclude=["lm_head", "*router"]))
    codes = _codes(cli, d)[1]
    assert ("EXC001", "exclude: *router") in codes
    assert Counter(c for c, _ in codes)["EXC004"] == 2


def test_ct_mxfp4_w4a8_is_named(cli, real_copy):
    fp8 = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    d = _with_quant(real_copy, "llama-ct-mxfp4", lambda q: q["config_groups"]["group_0"].update(input_activations=fp8))
    r, codes = _codes(cli, d)
    assert ("CFG003", "config.json: quantization_config: config_groups.group_0") in codes
    assert "W4A8" in r.json["findings"][0]["message"]


@pytest.mark.parametrize("name", [n for n in FOLDERS if "-ct-" in n])
def test_weight_only_ct_dense_layers_are_served_w4a4(cli, name):
    """MXFP4A16 (no input_activations) dense layers: vLLM 0.33's CompressedTensorsW4A4Mxfp4 quantizes their
    activations anyway on sm_90 and sm_100 (SEMANTICS §19.4); the MXFP4 preset declares it (README's table)."""
    warned = [f for f in cli("--json", "validate", REAL / name).json["findings"] if f["code"] == "VLL003"]
    assert len(warned) == ("mxfp4a16" in name)
    assert not [f for f in cli("--json", "validate", REAL / name, "--engine", "sglang").json["findings"]
                if f["code"] == "VLL003"]
