"""``validate --engine``: SGLang 0.5.23's reading of real ModelOpt exports and minimal edits of them, one
rule per test (``mocli/engines/sglang.py``), against vLLM's reading of the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mocli.numerics.in_torch import unpack_e2m1
from tests.conftest import REAL


def _codes(cli, d: Path, engine: str) -> tuple[int, list[tuple[str, str]]]:
    r = cli("--json", "validate", d, "--engine", engine)
    return r.exit_code, [(f["code"], f["location"]) for f in r.json["findings"]]


def _exclude(d: Path, *entries: str) -> None:
    for name, path in (("hf_quant_config.json", ("quantization", "exclude_modules")),
                       ("config.json", ("quantization_config", "ignore"))):
        data = json.loads((d / name).read_text())
        data[path[0]][path[1]] += list(entries)
        (d / name).write_text(json.dumps(data, indent=2))


def _set_algo(d: Path, algo: str) -> None:
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        data = json.loads((d / name).read_text())
        data[key]["quant_algo"] = algo
        (d / name).write_text(json.dumps(data, indent=2))


def _to_bf16(d: Path, modules: list[str]) -> None:
    """The named NVFP4 modules stored dequantized in BF16 (what an export that kept them unquantized holds)."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    for m in modules:
        q, bs, s2 = t.pop(f"{m}.weight"), t.pop(f"{m}.weight_scale"), t.pop(f"{m}.weight_scale_2")
        t.pop(f"{m}.input_scale", None)
        w = unpack_e2m1(q) * bs.float().repeat_interleave(16, dim=1) * s2.float()
        t[f"{m}.weight"] = w.bfloat16()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["qwen3_moe-nvfp4_kv", "llama-fp8_kv"])
def test_clean_real_exports_pass_both_engines(cli, name):
    for engine in ("sglang", "all"):
        code, found = _codes(cli, REAL / name, engine)
        assert code == 0 and not found, (engine, found)


def test_sglang_36596_wildcard_shards_of_a_fused_layer(cli, real_copy):
    """sglang#36596: the shards a checkpoint keeps BF16 excluded by per-projection wildcards; SGLang
    builds the fused qkv_proj quantized (an NVFP4 layer then fails to load). vLLM's fnmatch on the fused
    name misses them too: each engine says so in its own finding."""
    d = real_copy("qwen3_moe-nvfp4_kv")
    _to_bf16(d, [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
    _exclude(d, "*.layers.1.self_attn.q_proj", "*.layers.1.self_attn.k_proj", "*.layers.1.self_attn.v_proj")
    code, found = _codes(cli, d, "sglang")
    assert code == 1 and ("SGL001", "model.layers.1.self_attn.qkv_proj") in found, found
    code, found = _codes(cli, d, "vllm")
    assert code == 1 and ("EXC004", "model.layers.1.self_attn.qkv_proj") in found, found


def test_an_moe_layer_excluded_as_a_path_only_vllm_reads(cli, real_copy):
    """``model.layers.1.mlp.experts.*`` over experts stored BF16: vLLM excludes the layer (the entry holds
    its name), SGLang's regex must match the layer name whole and builds it quantized."""
    d = real_copy("qwen3_moe-nvfp4_kv")
    _to_bf16(d, [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")])
    _exclude(d, "model.layers.1.mlp.experts.*")
    assert _codes(cli, d, "vllm") == (0, [])
    code, found = _codes(cli, d, "sglang")
    assert code == 1 and found == [("SGL001", "model.layers.1.mlp.experts")], found
    code, found = _codes(cli, d, "all")
    assert code == 1 and found == [("SGL001", "model.layers.1.mlp.experts")], found


def test_a_component_match_unquantizes_a_stored_quantized_layer(cli, real_copy):
    """``o_*`` fully matches the component ``o_proj`` in SGLang; vLLM's fnmatch reads the whole name."""
    d = real_copy("llama-fp8_kv")
    _exclude(d, "o_*")
    code, found = _codes(cli, d, "sglang")
    assert code == 1 and {c for c, _ in found} == {"SGL002"} and ("SGL002", "model.layers.0.self_attn.o_proj") in found
    code, found = _codes(cli, d, "vllm")
    assert code == 0 and found == [("EXC001", "exclude_modules: o_*")], found


def test_mixed_precision_without_packed_modules_mapping(cli):
    """The real Mixtral MIXED_PRECISION export: SGLang's Mixtral declares no packed_modules_mapping, so the
    fused q/k/v that quantized_layers lists shard by shard resolve to no algorithm (built unquantized)."""
    code, found = _codes(cli, REAL / "mixtral-mixed", "sglang")
    assert code == 1 and found == [("SGL002", "model.layers.0.self_attn.qkv_proj"),
                                   ("SGL002", "model.layers.1.self_attn.qkv_proj")], found
    assert _codes(cli, REAL / "qwen3_moe-mixed", "sglang") == (0, [])  # Qwen3-MoE declares one


def test_a_dotted_path_entry_splits_a_fused_group(cli, real_copy):
    d = real_copy("llama-fp8_kv")
    _exclude(d, "q_proj")
    code, found = _codes(cli, d, "sglang")
    assert code == 1 and found == [("SGL003", "model.layers.0.self_attn.qkv_proj"),
                                   ("SGL003", "model.layers.1.self_attn.qkv_proj")], found
    assert _codes(cli, d, "vllm") == (0, [("EXC001", "exclude_modules: q_proj")])


@pytest.mark.parametrize("algo", ["fp8", "FP8_PB_WO"])
def test_algorithms_sglang_does_not_load(cli, real_copy, algo):
    """ModelOpt writes some names in lower case, which vLLM upper-cases and SGLang refuses; FP8_PB_WO has no
    SGLang ModelOpt config outside MIXED_PRECISION."""
    d = real_copy("llama-fp8_kv")
    _set_algo(d, algo)
    code, found = _codes(cli, d, "sglang")
    assert code == 1 and ("SGL004", "config.json: quant_algo") in found, found


def test_mixed_precision_layer_algorithms_sglang_builds_unquantized(cli, real_copy):
    d = real_copy("qwen3_moe-mixed")
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        data = json.loads((d / name).read_text())
        for layer, spec in data[key]["quantized_layers"].items():
            if "self_attn" in layer:
                spec["quant_algo"] = "FP8_PER_CHANNEL_PER_TOKEN"
        (d / name).write_text(json.dumps(data, indent=2))
    code, found = _codes(cli, d, "sglang")
    assert code == 1 and ("SGL005", "config.json: quantized_layers") in found, found


def test_nvfp4_kv_cache_is_not_sglang_default(cli):
    code, found = _codes(cli, REAL / "qwen3_moe-nvfp4-nvfp4_kv", "sglang")
    assert [f for f in found if f[0].startswith("SGL")] == [("SGL006", "config.json: kv_cache_quant_algo")], found


def test_live_regex_entries_are_named_not_evaluated(cli, real_copy):
    d = real_copy("llama-fp8_kv")
    _exclude(d, "lm_head|embed", "(a+)+$")
    code, found = _codes(cli, d, "sglang")
    assert code == 0 and found == [("SGL007", "exclude_modules: lm_head|embed"), ("SGL007", "exclude_modules: (a+)+$")]


def test_wildcards_are_matched_without_backtracking():
    """A pattern of many '*' against a long name, which SGLang's regex translation would backtrack on for
    ages: mocli's matcher places each literal once (this returns at once; a regex would not)."""
    from mocli.engines.sglang import glob_full

    assert not glob_full("*a" * 40 + "!", "a" * 2000)
    assert glob_full("model.*.mlp.*", "model.layers.3.mlp.experts") and not glob_full("model.*.mlp", "model.x.mlp.y")
    assert glob_full("*", "") and glob_full("a*b*c", "abc") and not glob_full("a*b*c", "acb")


@given(st.text(alphabet="ab.*", max_size=8), st.text(alphabet="ab.", max_size=10))
def test_wildcard_matching_is_sglangs_regex_full_match(pattern, text):
    """The same answer as SGLang's own translation (``.`` escaped, ``*`` -> ``.*``, ``re.fullmatch``) on
    small inputs, where the regex is safe to run."""
    import re

    from mocli.engines.sglang import glob_full

    assert glob_full(pattern, text) == bool(re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), text))
