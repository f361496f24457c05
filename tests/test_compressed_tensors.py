"""compressed-tensors checkpoints (llm-compressor 0.14's exports in fixtures/real, SEMANTICS §17): read as vLLM 0.33
reads them (names, divisors, BF16 and [1] scales, ignore/targets matching, the float16 requantization), validated,
converted for every target that serves them and verified."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mocli import ct_patterns
from mocli.compressed_tensors import PatternTimeout, Resolver, matches
from mocli.ct_patterns import slow_under_re, static_hazard
from mocli.findings import Findings
from mocli.ops import fp8
from mocli.quant_config import Algo
from tests.conftest import REAL

DENSE = ["llama-ct-nvfp4", "llama-ct-nvfp4a16", "llama-ct-fp8", "llama-ct-fp8_dynamic", "llama-ct-fp8_block"]
MOE = ["qwen3_moe-ct-nvfp4", "qwen3_moe-ct-nvfp4a16", "qwen3_moe-ct-fp8", "qwen3_moe-ct-fp8_dynamic",
       "qwen3_moe-ct-fp8_block"]
TARGETS = ["flashinfer-cutlass", "flashinfer-trtllm", "marlin"]
# (checkpoint, target) -> the TGT002 refusal's subject; every other pair converts
REFUSED = {(f"{arch}-ct-nvfp4a16", t): "W4A16_NVFP4" for arch in ("llama", "qwen3_moe")
           for t in ("flashinfer-cutlass", "flashinfer-trtllm")}
REFUSED |= {("qwen3_moe-ct-fp8_dynamic", t): "FP8_PER_CHANNEL_PER_TOKEN experts" for t in TARGETS}
REFUSED[("qwen3_moe-ct-fp8_block", "marlin")] = "FP8_PB_WO experts"  # FlashInfer's block-scale MoE only (§18)


@pytest.mark.parametrize("name", DENSE + MOE)
def test_llm_compressor_exports_validate_clean(cli, name):
    r = cli("--json", "validate", REAL / name)
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]
    info = cli("--json", "inspect", REAL / name).json
    assert info["quant_method"] == "compressed-tensors" and info["producer"]["name"] == "compressed-tensors"
    # llm-compressor writes ignore as exact names (the MoE routers too), each matching itself
    assert info["exclusions"] and all(e["matches"] == [e["pattern"]] for e in info["exclusions"])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", DENSE + MOE)
def test_llm_compressor_exports_convert_and_verify(cli, tmp_path, name, target):
    out = tmp_path / "o"
    r = cli("convert", REAL / name, "-o", out, "--target", target)
    if (name, target) in REFUSED:
        assert r.exit_code == 1 and "TGT002" in r.stderr and REFUSED[name, target] in r.stderr, r.stderr
        assert not out.exists()
        return
    assert r.exit_code == 0, r.stderr
    assert cli("verify", out).exit_code == 0


@pytest.mark.parametrize("name", ["qwen3_moe-ct-nvfp4", "qwen3_moe-ct-fp8"])
def test_an_moe_export_converts_for_two_by_two_ranks(cli, tmp_path, name):
    out = tmp_path / "o"
    assert cli("convert", REAL / name, "-o", out, "--target", "flashinfer-trtllm", "--tp", 2, "--ep", 2).exit_code == 0
    assert cli("verify", out).exit_code == 0


def test_the_linear_input_scale_inv_is_the_stored_divisor(cli, tmp_path):
    """vLLM's compressed-tensors NVFP4 linear keeps max(input_global_scale) as is (§17.3): not the float32
    double reciprocal of it, which differs for some of the real export's values."""
    src = load_file(str(REAL / "llama-ct-nvfp4" / "model.safetensors"))
    out = tmp_path / "o"
    assert cli("convert", REAL / "llama-ct-nvfp4", "-o", out, "--target", "flashinfer-cutlass").exit_code == 0
    got = load_file(str(next(out.glob("*.safetensors"))))
    groups = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
              "self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",)}
    moved = 0
    for layer in range(2):
        for fused, shards in groups.items():
            parent = f"model.layers.{layer}.{fused.rpartition('.')[0]}"
            g = max(float(src[f"{parent}.{s}.input_global_scale"]) for s in shards)
            inv = got[f"model.layers.{layer}.{fused}.input_scale_inv"]
            assert inv.dtype == torch.float32 and float(inv) == g
            moved += np.reciprocal(np.reciprocal(np.float32(g))) != np.float32(g)
    assert moved > 0  # the double reciprocal would have been caught here


def _vllm_requantize(q: torch.Tensor, s: float, big: float) -> torch.Tensor:
    """vLLM 0.33's ``per_tensor_dequantize`` (a float16 weight times a 0-dim float32 scale: on a GPU torch
    rounds the scale to float16 as well, measured on an H200, tests/test_gpu.py) then a static FP8
    quantization at ``big`` (x * (1 / big), clamped, cast), in torch."""
    dq = q.to(torch.float16) * torch.tensor(s, dtype=torch.float32).half()
    return (dq.float() * (1 / torch.tensor(big, dtype=torch.float32))).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("s,big", [(2.0e-3, 2.0e-3), (3.1e-3, 4.7e-3), (1.3e-6, 1.3e-6), (1.7e-6, 2.9e-6)])
def test_per_tensor_fp8_requantizes_through_float16_as_vllm_does(s, big):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes are refused before requantization
    want = _vllm_requantize(codes.view(torch.float8_e4m3fn), s, big).view(torch.uint8).numpy()
    got = fp8.requantize_fp8(codes.numpy(), np.float32(s), np.float32(big), f16=True)
    assert (got == want).all()
    if s < 1e-5:  # float16's subnormal range: its rounding moves codes the float32 formula keeps
        assert (fp8.requantize_fp8(codes.numpy(), np.float32(s), np.float32(big)) != want).any()


def test_matching_is_exact_or_re_anchored_at_the_start():
    name = "model.layers.0.mlp.gate"
    assert matches("model.layers.0.mlp.gate", name) and not matches("model.layers.0.mlp", name)
    assert matches(r"re:.*mlp\.gate$", name) and matches(r"re:model\.layers", name)  # re.match: a prefix will do
    assert not matches(r"re:mlp\.gate", name)  # anchored at the start, not searched
    assert not matches("*.mlp.gate", name) and not matches("mlp.gate", name)  # no fnmatch, no substring


def _resolver(targets, ignore=()):
    return Resolver(targets, list(ignore), Findings(), "config.json")


def test_resolution_follows_vllm_order():
    r = _resolver({r"re:.*self_attn.*": Algo.FP8, "Linear": Algo.NVFP4}, ["lm_head", r"re:.*mlp\.gate$"])
    assert r("model.layers.0.self_attn.q_proj") is Algo.FP8  # an explicit target before the class name
    assert r("model.layers.0.mlp.experts.3.down_proj") is Algo.NVFP4  # Linear reaches routed experts
    assert r("model.layers.0.mlp.gate") is None and r("lm_head") is None
    # the fused name is asked first: a target on qkv_proj reaches its shards
    assert _resolver({r"re:.*qkv_proj$": Algo.FP8})("model.layers.0.self_attn.k_proj") is Algo.FP8
    # an MoE layer's experts are asked for by the layer's name
    assert _resolver({}, [r"re:.*experts$"])("model.layers.1.mlp.experts.0.up_proj") is None


def _ct_copy(tmp_path, name: str, edit) -> object:
    d = tmp_path / name
    shutil.copytree(REAL / name, d)
    j = json.loads((d / "config.json").read_text())
    edit(j["quantization_config"])
    (d / "config.json").write_text(json.dumps(j))
    return d


def test_a_pathological_pattern_is_bounded_and_named(cli, tmp_path):
    """``(a|aa)+$`` backtracks exponentially on a run of a's: re would hang; mocli stops each match at its limit,
    reports the pattern once (CFG008) and treats it as matching nothing."""
    d = _ct_copy(tmp_path, "llama-ct-nvfp4", lambda q: q["ignore"].append("re:.*(a|aa)+$"))
    t = load_file(str(d / "model.safetensors"))
    t["model." + "a" * 60 + "!.weight"] = torch.zeros(1)  # a module name that triggers the backtracking
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    start = time.monotonic()
    r = cli("--json", "validate", d)
    assert time.monotonic() - start < 30
    assert [f["code"] for f in r.json["findings"]] == ["CFG008"] and r.exit_code == 1
    with pytest.raises(PatternTimeout):
        matches("re:.*(a|aa)+$", "a" * 60 + "!")


def test_modelopt_style_ignore_entries_match_nothing_and_are_named(cli, tmp_path):
    d = _ct_copy(tmp_path, "llama-ct-fp8", lambda q: q["ignore"].append("*lm_head*"))
    r = cli("--json", "validate", d)
    f = [x for x in r.json["findings"] if x["code"] == "EXC001"]
    assert len(f) == 1 and f[0]["location"] == "ignore: *lm_head*" and "wildcards" in f[0]["hint"]


def test_shards_resolved_to_different_schemes_are_refused(cli, tmp_path):
    d = _ct_copy(tmp_path, "llama-ct-fp8", lambda q: q["ignore"].append("model.layers.0.self_attn.k_proj"))
    codes = {f["code"]: f for f in cli("--json", "validate", d).json["findings"]}
    assert "EXC002" in codes and codes["EXC002"]["location"] == "model.layers.0.self_attn.qkv_proj"


def test_nvfp4_kv_cache_is_refused_as_vllm_does(cli, tmp_path):
    d = _ct_copy(tmp_path, "llama-ct-nvfp4", lambda q: q.__setitem__(
        "kv_cache_scheme", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}))
    r = cli("--json", "validate", d)
    assert r.exit_code == 1 and any(f["code"] == "CFG003" and "kv_cache_scheme" in f["location"]
                                    for f in r.json["findings"])


def test_a_quantized_embedding_is_refused_by_convert(cli, tmp_path):
    from fixtures.generate import make_broken

    path, _ = make_broken("TNS008", tmp_path / "m")
    r = cli("convert", path, "-o", tmp_path / "o", "--target", "flashinfer-cutlass")
    assert r.exit_code == 1 and "TNS008" in r.stderr and "model.embed_tokens" in r.stderr
    assert not (tmp_path / "o").exists()


def test_nvfp4_experts_with_fp8_attention_in_two_config_groups(cli, tmp_path):
    """The common mixed recipe: NVFP4 experts, FP8 attention, one config group each, made from the two real
    exports of the same weights."""
    d = tmp_path / "mixed"
    shutil.copytree(REAL / "qwen3_moe-ct-nvfp4", d)
    nv, f8 = (load_file(str(REAL / n / "model.safetensors")) for n in ("qwen3_moe-ct-nvfp4", "qwen3_moe-ct-fp8"))
    t = {k: v for k, v in nv.items() if ".self_attn." not in k or "norm" in k}
    t |= {k: v for k, v in f8.items() if ".self_attn." in k and "norm" not in k}
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    q, q8 = cfg["quantization_config"], json.loads((REAL / "qwen3_moe-ct-fp8" / "config.json").read_text())[
        "quantization_config"]
    q["config_groups"]["group_0"]["targets"] = [r"re:.*mlp\.experts.*"]
    q["config_groups"]["group_1"] = {**q8["config_groups"]["group_0"], "targets": [r"re:.*self_attn.*"]}
    (d / "config.json").write_text(json.dumps(cfg))
    r = cli("--json", "validate", d)
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]
    assert cli("--json", "inspect", d).json["stored_schemes"] == ["FP8", "NVFP4"]
    out = tmp_path / "o"
    assert cli("convert", d, "-o", out, "--target", "flashinfer-trtllm").exit_code == 0
    assert cli("verify", out).exit_code == 0


def test_fp8_scales_are_dequant_scales_not_divisors(cli, tmp_path):
    """compressed-tensors' FP8 ``input_scale`` and ``weight_scale`` multiply, as ModelOpt's do; only the NVFP4
    global scales (``*_global_scale``) are divisors: a converted FP8 layer keeps the source's values (max)."""
    src = load_file(str(REAL / "llama-ct-fp8" / "model.safetensors"))
    out = tmp_path / "o"
    assert cli("convert", REAL / "llama-ct-fp8", "-o", out, "--target", "flashinfer-cutlass").exit_code == 0
    got = load_file(str(next(out.glob("*.safetensors"))))
    p = "model.layers.0.mlp."
    for role in ("input_scale", "weight_scale"):
        want = max(float(src[f"{p}{s}.{role}"]) for s in ("gate_proj", "up_proj"))
        assert float(got[f"{p}gate_up_proj.{role}"]) == want


# --- the fields vLLM 0.33 reads (issue 43 item 4): compressed_tensors.py :: _get_scheme_from_parts, _is_nvfp4_format,
# _is_fp8_w8a8, _is_fp8_w8a16, is_activation_quantization_format, validate_kv_cache_scheme -------------------------

def _group(field: str, value, role: str = "weights", group: str = "group_0"):
    def edit(q):
        q["config_groups"][group][role][field] = value
    return edit


def _set(key: str, value, group: str | None = "group_0"):
    def edit(q):
        (q["config_groups"][group] if group else q)[key] = value
    return edit


def _kv(**fields):
    def edit(q):
        q["kv_cache_scheme"] = {k: v for k, v in {**q["kv_cache_scheme"], **fields}.items() if v is not None}
    return edit


Q = "config.json: quantization_config"
G0 = Q + ": config_groups.group_0"
FIELD_CASES = {  # id: (real export, edit, code, location, words of the message)
    "float-quantized over NVFP4": ("llama-ct-nvfp4", _set("format", "float-quantized"), "CFG002", G0,
                                   "'float-quantized' contradicts its NVFP4 weights"),
    "top-level format over NVFP4A16": ("qwen3_moe-ct-nvfp4a16", lambda q: (q["config_groups"]["group_0"].pop("format"),
                                       q.__setitem__("format", "float-quantized")), "CFG002", G0, "contradicts"),
    "nvfp4-pack-quantized over FP8": ("llama-ct-fp8", _set("format", "nvfp4-pack-quantized"), "CFG002", G0,
                                      "contradicts its FP8 weights"),
    "unknown format": ("llama-ct-nvfp4", _set("format", "nvfp4-packed"), "CFG002", G0,
                       "'nvfp4-packed' is not a compressed-tensors format"),
    "FP8 under pack-quantized": ("qwen3_moe-ct-fp8", _set("format", "pack-quantized"), "CFG002", G0,
                                 "vLLM builds no FP8 linear"),
    "FP8 with no format at all": ("llama-ct-fp8_dynamic", lambda q: (q["config_groups"]["group_0"].pop("format"),
                                  q.pop("format")), "CFG002", G0, "no format"),
    "asymmetric NVFP4 weights": ("llama-ct-nvfp4", _group("symmetric", False), "CFG002", G0 + ".weights",
                                 "asymmetric"),
    "asymmetric FP8 weights": ("qwen3_moe-ct-fp8_block", _group("symmetric", False), "CFG002", G0 + ".weights",
                               "asymmetric"),
    "dynamic FP8 weights": ("llama-ct-fp8", _group("dynamic", True), "CFG002", G0 + ".weights", "dynamic"),
    "NVFP4 group of 32": ("llama-ct-nvfp4a16", _group("group_size", 32), "CFG002", G0 + ".weights", "group_size 32"),
    "FP8 inputs beside NVFP4": ("llama-ct-nvfp4", lambda q: q["config_groups"]["group_0"].__setitem__(
        "input_activations", {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}),
        "CFG002", G0 + ".input_activations", "must also be NVFP4"),
    "asymmetric static FP8 inputs": ("llama-ct-fp8", _group("symmetric", False, "input_activations"), "CFG002",
                                     G0 + ".input_activations", "asymmetric"),
    "int8 static inputs beside FP8": ("qwen3_moe-ct-fp8", _group("type", "int", "input_activations"), "CFG002",
                                      G0 + ".input_activations", "int 8-bit"),
    "FP4 static inputs beside FP8": ("llama-ct-fp8", _group("num_bits", 4, "input_activations"), "CFG002",
                                     G0 + ".input_activations", "float 4-bit"),
    "FP8 channel weight-only": ("llama-ct-fp8_dynamic", _set("input_activations", None), "CFG003", G0,
                                "weight-only (W8A16)"),
    "per-tensor FP8 with dynamic inputs": ("llama-ct-fp8", _group("dynamic", True, "input_activations"), "CFG003",
                                           G0, "a scheme mocli does not read"),
    "unknown type": ("llama-ct-fp8", _group("type", "floaty"), "CFG002", G0 + ".weights", "'floaty'"),
    "num_bits as a string": ("llama-ct-fp8", _group("num_bits", "8"), "CFG002", G0 + ".weights", "num_bits '8'"),
    "unknown strategy": ("llama-ct-fp8", _group("strategy", "per_tensor"), "CFG002", G0 + ".weights",
                         "'per_tensor'"),
    "group activation ordering": ("llama-ct-fp8", _group("actorder", "group"), "CFG002", G0 + ".weights",
                                  "actorder 'group'"),
    "targets as one string": ("llama-ct-nvfp4", _set("targets", "Linear"), "CFG002", G0, "list of strings"),
    "asymmetric KV cache": ("qwen3_moe-nvfp4_kv-ct", _kv(symmetric=False), "CFG002", Q + ": kv_cache_scheme",
                            "symmetric False"),
    "KV cache without symmetric": ("qwen3_moe-nvfp4_kv-ct", _kv(symmetric=None), "CFG002",
                                   Q + ": kv_cache_scheme", "symmetric None"),
    "KV cache per channel": ("qwen3_moe-nvfp4_kv-ct", _kv(strategy="channel"), "CFG002",
                             Q + ": kv_cache_scheme", "strategy 'channel'"),
    "KV cache without a strategy": ("qwen3_moe-nvfp4_kv-ct", _kv(strategy=None), "CFG002",
                                    Q + ": kv_cache_scheme", "strategy None"),
}


@pytest.mark.parametrize("case", FIELD_CASES)
def test_fields_vllm_reads_are_checked_as_it_checks_them(cli, tmp_path, case):
    name, edit, code, location, words = FIELD_CASES[case]
    d = _ct_copy(tmp_path, name, edit)
    r = cli("--json", "validate", d)
    found = [f for f in r.json["findings"] if f["code"] == code]
    assert r.exit_code == 1 and len(found) == 1, r.json["findings"]
    assert found[0]["location"] == location and words in found[0]["message"], found[0]


@pytest.mark.parametrize("case", ["float-quantized over NVFP4", "asymmetric NVFP4 weights", "asymmetric KV cache"])
def test_convert_refuses_what_vllm_refuses_or_misreads(cli, tmp_path, case):
    name, edit, code, _location, _words = FIELD_CASES[case]
    d = _ct_copy(tmp_path, name, edit)
    out = tmp_path / "o"
    r = cli("convert", d, "-o", out, "--target", "marlin")
    assert r.exit_code == 1 and code in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_compressed_tensors_defaults_are_vllms(cli, tmp_path):
    """Fields left out take QuantizationArgs' defaults (num_bits 8, symmetric true, strategy from group_size),
    as vLLM reads them: an FP8 per-tensor group that omits them validates clean."""
    def strip(q):
        for role in ("weights", "input_activations"):
            for k in ("num_bits", "symmetric", "strategy"):
                q["config_groups"]["group_0"][role].pop(k)
    d = _ct_copy(tmp_path, "llama-ct-fp8", strip)
    r = cli("--json", "validate", d)
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]


# --- re: patterns under Python's re (issue 43 item 3, mocli.ct_patterns): vLLM 0.33 matches with the regex module
# (utils/config_utils.py `import regex as re`), which mocli's matcher is (CFG008); SGLang and compressed-tensors'
# own matcher run Python's re, on which nested quantifiers backtrack exponentially (CFG009, a warning) -------------

EXPONENTIAL = r"re:((\w+\.?)+)+Z"  # hours under re on a 30-character name; 0.1 ms under regex
REGEX_ONLY_SLOW = r"re:(?:Qodel\.(\w+\.?)+){e<=3}[#!]"  # regex's fuzzy match backtracks; re fails at "Q" at once
NAME = "model.layers.0.self_attn.q_proj"


def _re_runs_past(pattern: str, name: str, seconds: float) -> bool:
    """Independent of mocli: does Python's re.match take longer than ``seconds`` (in a child killed after)?"""
    code = f"import re; re.match({pattern[3:]!r}, {name!r})"
    try:
        subprocess.run([sys.executable, "-c", code], timeout=seconds, check=True)
    except subprocess.TimeoutExpired:
        return True
    return False


def test_the_static_rule_flags_the_shapes_that_backtrack():
    for p in (r"((\w+\.?)+)+Z", r"(\w+)*\1\1\1\1Z", r"(?:[\w.]+)+\W", r"(.|.)*Z", r"model\.(\d+\.)+mlp", r"(a)\1"):
        assert static_hazard(p), p
    for p in (r".*mlp\.gate$", r"model\.layers\.\d+\.self_attn\..*", r".*(q|k|v)_proj$", r"lm_head", r"a++",
              r"(?:q|k|v)_proj", r"(?>\w+\.)*Z"):
        assert static_hazard(p) is None, p
    assert static_hazard(r"(?<=\w+)lm_head").startswith("not a Python re pattern")  # regex accepts it, re does not


@pytest.mark.parametrize("where", ["ignore", "targets"])
def test_a_pattern_slow_under_re_but_not_regex_is_cfg009(cli, tmp_path, where):
    assert _re_runs_past(EXPONENTIAL, NAME, 1.0)
    start = time.monotonic()
    assert not matches(EXPONENTIAL, NAME) and time.monotonic() - start < 0.05  # mocli's (vLLM's) matcher: at once

    def edit(q):
        (q["ignore"] if where == "ignore" else q["config_groups"]["group_0"]["targets"]).append(EXPONENTIAL)
    d = _ct_copy(tmp_path, "llama-ct-nvfp4", edit)
    start = time.monotonic()
    r = cli("--json", "validate", d)
    assert time.monotonic() - start < 20
    found = [f for f in r.json["findings"] if f["code"] == "CFG009"]
    assert r.exit_code == 0 and len(found) == 1 and "CFG008" not in {f["code"] for f in r.json["findings"]}
    assert found[0]["severity"] == "warning"
    assert found[0]["location"] == "config.json: quantization_config: " + (
        "ignore" if where == "ignore" else "config_groups.group_0.targets")
    msg = found[0]["message"]
    assert repr(EXPONENTIAL) in msg and "quantified group holding a quantifier" in msg
    assert re.search(r"on 'model\.[\w.]+'", msg)  # the module name it ran past the limit on


def test_a_pattern_slow_under_regex_but_not_re_is_cfg008(cli, tmp_path):
    """The reverse: vLLM's matcher (regex) is the engine's, so a pattern only it backtracks on is CFG008 (an error,
    the pattern treated as matching nothing); Python's re answers it at once, so no CFG009 beside it."""
    assert not _re_runs_past(REGEX_ONLY_SLOW, NAME, 1.0)
    with pytest.raises(PatternTimeout):
        matches(REGEX_ONLY_SLOW, NAME)
    assert slow_under_re([REGEX_ONLY_SLOW], [NAME] * 3, limit=0.5) == []
    d = _ct_copy(tmp_path, "llama-ct-nvfp4", lambda q: q["ignore"].append(REGEX_ONLY_SLOW))
    r = cli("--json", "validate", d)
    codes = [f["code"] for f in r.json["findings"]]
    assert r.exit_code == 1 and codes.count("CFG008") == 1 and "CFG009" not in codes, r.json["findings"]
    assert next(f for f in r.json["findings"] if f["code"] == "CFG008")["location"].endswith(": ignore")


def _prime(patterns: list[str], names: list[str], seconds: float) -> Findings:
    f = Findings()
    r = Resolver({p: Algo.NVFP4 for p in patterns}, [], f, "config.json", {p: "config_groups.g.targets" for p in patterns})
    r.prime(names, f, re_seconds=seconds)
    return f


def test_plain_patterns_spawn_no_worker(monkeypatch):
    def no_worker(*a, **k):
        raise AssertionError("a worker was started for plain patterns")
    monkeypatch.setattr(ct_patterns.subprocess, "Popen", no_worker)
    names = [f"model.layers.{i}.self_attn.{s}_proj" for i in range(4) for s in "qkvo"]
    assert list(_prime([r"re:.*self_attn\.(q|k|v)_proj$", r"re:model\.layers\.\d+\.", "lm_head", "Linear"],
                       names, 0.05)) == []


def test_suspicious_patterns_that_answer_in_time_are_no_finding():
    names = [f"model.layers.{i}.self_attn.{s}_proj" for i in range(8) for s in "qkvo"]
    start = time.monotonic()
    assert list(_prime([r"re:model\.layers\.(\d+\.)+self_attn", r"re:(\w+)*\1\1\1\1Z"], names, 1.0)) == []
    assert time.monotonic() - start < 3


def test_several_slow_patterns_each_named_in_one_bounded_pass():
    names = [NAME, "model.layers.1.mlp.down_proj"]
    slow = [EXPONENTIAL, r"re:(?:[\w.]+)+[A-Z]", r"re:(.|.)*Z"]
    start = time.monotonic()
    found = _prime([r"re:model\.(\d+\.)+x", *slow], names, 0.2)
    assert time.monotonic() - start < 5
    assert [f.code for f in found] == ["CFG009"] * 3
    assert [next(p for p in slow if repr(p) in f.message) for f in found] == slow
    assert all(f.location == "config.json: config_groups.g.targets" and repr(NAME) in f.message for f in found)


def test_an_attention_only_group_is_skipped_as_vllm_skips_it(cli, tmp_path):
    """compressed_tensors.py :: from_config drops a group whose one target is an attention class (its quantization
    is the KV cache's): llm-compressor's attention recipes write one, with no weights."""
    def edit(q):
        q["config_groups"]["attn"] = {"targets": ["LlamaAttention"], "weights": None, "input_activations": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
    r = cli("--json", "validate", _ct_copy(tmp_path, "llama-ct-fp8", edit))
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]


def test_an_fp8_group_over_packed_nvfp4_tensors_is_tns005(cli, tmp_path):
    """The whole group respelled FP8 (float-quantized, as the FP8 export writes it) over the NVFP4 export's packed
    U8 weights: the config is consistent in itself, so the stored tensors are what contradict it."""
    fp8 = json.loads((REAL / "llama-ct-fp8" / "config.json").read_text())["quantization_config"]
    d = _ct_copy(tmp_path, "llama-ct-nvfp4", lambda q: (q["config_groups"].__setitem__("group_0", fp8["config_groups"][
        "group_0"]), q.__setitem__("format", "float-quantized")))
    r = cli("--json", "validate", d)
    codes = {f["code"] for f in r.json["findings"]}
    assert r.exit_code == 1 and codes == {"TNS005"}, r.json["findings"]
    assert all("stored as NVFP4 but the config says FP8" in f["message"] for f in r.json["findings"])
