"""Both config styles parse into one model; disagreements and bad fields become findings."""

from __future__ import annotations

import json

from mocli.checkpoint import open_checkpoint
from mocli.findings import Findings
from mocli.quant_config import Algo, parse_config_json, parse_hf_quant_config, reconcile
from tests.conftest import REAL_LLAMA, REAL_QWEN


def _codes(f: Findings) -> list[str]:
    return [x.code for x in f]


def test_real_exports_parse_identically_from_both_files():
    for path, algo, gs in ((REAL_LLAMA, Algo.FP8, None), (REAL_QWEN, Algo.NVFP4, 16)):
        f = Findings()
        hf = parse_hf_quant_config(json.loads((path / "hf_quant_config.json").read_text()), f)
        cj = parse_config_json(json.loads((path / "config.json").read_text()), f)
        assert not f
        assert hf.algo is algo and cj.algo is algo
        assert hf.kv_cache_algo == cj.kv_cache_algo == "FP8"
        assert sorted(hf.exclude_modules) == sorted(cj.exclude_modules)
        if gs:
            assert hf.group_size == cj.group_size == gs
        reconcile(hf, cj, f)
        assert not f


def test_algorithm_matching_is_case_insensitive():
    f = Findings()
    q = parse_hf_quant_config({"quantization": {"quant_algo": "fp8_pb_wo"}}, f)
    assert q.algo is Algo.FP8_PB_WO and not f


def test_nvfp4_required_keys_each_reported():
    f = Findings()
    parse_hf_quant_config({"quantization": {"quant_algo": "NVFP4"}}, f)
    msgs = [x.message for x in f if x.code == "CFG001"]
    assert len(msgs) == 3
    assert any("group_size" in m for m in msgs) and any("kv_cache_quant_algo" in m for m in msgs)


def test_wrong_types_and_unknown_algo():
    f = Findings()
    parse_hf_quant_config({"quantization": {"quant_algo": 8, "group_size": "16", "exclude_modules": [1]}}, f)
    assert _codes(f).count("CFG002") == 3
    f = Findings()
    parse_hf_quant_config({"quantization": {"quant_algo": "INT4_AWQ"}}, f)
    assert _codes(f) == ["CFG003"]


def test_config_json_group_size_defaults_to_16():
    f = Findings()
    q = parse_config_json({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, f)
    assert q.group_size == 16 and not f


def test_mixed_precision_layers():
    f = Findings()
    q = parse_hf_quant_config({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "a.q_proj": {"quant_algo": "FP8"}, "a.o_proj": {"quant_algo": "nvfp4", "group_size": 16},
        "a.bad": {"quant_algo": "NVFP4"}}}}, f)
    assert q.algo_for("a.q_proj") is Algo.FP8 and q.algo_for("a.o_proj") is Algo.NVFP4
    assert q.algo_for("a.k_proj") is None
    assert _codes(f) == ["CFG001"]  # a.bad: NVFP4 without group_size


def test_disagreement_names_both_values():
    f = Findings()
    hf = parse_hf_quant_config({"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}, f)
    cj = parse_config_json({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                    "ignore": ["lm_head"]}}, f)
    eff = reconcile(hf, cj, f)
    assert eff is hf
    assert _codes(f) == ["CFG004"] and "FP8" in f[0].message and "NVFP4" in f[0].message


def test_non_modelopt_quant_method(tmp_path):
    f = Findings()
    assert parse_config_json({"quantization_config": {"quant_method": "gptq"}}, f) is None
    assert _codes(f) == ["CFG005"]


def test_fp8_quant_method_is_vllms_serialized_format():
    f = Findings()
    q = parse_config_json({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                   "ignored_layers": ["lm_head"]}}, f)
    assert not f and q.method == "fp8" and q.dynamic_activations and q.exclude_modules == ["lm_head"]
    q = parse_config_json({"quantization_config": {"quant_method": "fp8", "activation_scheme": "tensor"}}, f)
    assert _codes(f) == ["CFG002"] and not q.dynamic_activations


def test_checkpoint_effective_config_prefers_hf_quant_config():
    ck = open_checkpoint(REAL_QWEN)
    assert ck.quant is ck.hf_quant_config and ck.quant.origin == "hf_quant_config.json"
