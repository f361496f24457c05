"""What ModelOpt 0.47 exports, read as the engines read it (fixtures/real, made with nvidia-modelopt 0.47.0):
NVFP4 KV caches (config.json's bare "NVFP4"), MIXED_PRECISION MoE (experts listed once per layer under
the FusedMoE container, no exclude_modules), without false refusals; affine KV caches refused (KVC001)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from mocli.census import build_census
from mocli.checkpoint import open_checkpoint
from mocli.findings import Findings
from mocli.quant_config import parse_config_json
from tests.conftest import REAL, edit_tensor

NVFP4_KV = ["qwen3_moe-nvfp4-nvfp4_kv", "llama-fp8-nvfp4_kv"]
MIXED_MOE = ["qwen3_moe-mixed", "mixtral-mixed"]


def _tensors(d) -> dict:
    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    return out


@pytest.mark.parametrize("name", NVFP4_KV)
def test_nvfp4_kv_export_converts_with_its_scales_passed_through(cli, tmp_path, name):
    src = REAL / name
    r = cli("--json", "validate", src, "--engine", "vllm")
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]
    assert cli("--json", "inspect", src).json["kv_cache_quant_algo"] == "NVFP4"
    out = tmp_path / "o"
    assert cli("convert", src, "-o", out, "--target", "flashinfer-cutlass", "--tp", 2).exit_code == 0
    manifest = json.loads((out / "mocli-layout.json").read_text())
    assert manifest["serving"]["vllm"]["kv_cache_dtype"] == "nvfp4"  # vLLM's own map: nvfp4 -> "nvfp4"
    s, o = _tensors(src), _tensors(out)
    kv = [n for n in s if n.endswith((".k_scale", ".v_scale"))]
    assert len(kv) == 4 and all(o[n].dtype == s[n].dtype and o[n].equal(s[n]) for n in kv)
    assert cli("verify", out).exit_code == 0


@pytest.mark.parametrize("scheme,algo", [("NVFP4", "NVFP4"), ("nvfp4", "NVFP4"), ({"num_bits": 4, "type": "float"}, "NVFP4"),
                                         ({"num_bits": 8, "type": "float", "dynamic": False}, "FP8"), ("FP8", "FP8")])
def test_kv_cache_scheme_spellings(scheme, algo):
    findings = Findings()
    cfg = parse_config_json({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                     "kv_cache_scheme": scheme}}, findings)
    assert cfg.kv_cache_algo == algo and not findings


def test_unknown_kv_cache_scheme_is_named():
    findings = Findings()
    parse_config_json({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                               "kv_cache_scheme": {"num_bits": 4, "type": "int"}}}, findings)
    assert [f.code for f in findings] == ["CFG003"]


@pytest.mark.parametrize("name", MIXED_MOE)
def test_mixed_precision_moe_as_modelopt_047_writes_it(cli, tmp_path, name):
    """Experts configured by their layer's container entry (``…experts``: NVFP4), attention per module
    (FP8), routers and lm_head listed nowhere (unquantized): validate is clean, every target converts and
    verifies."""
    src = REAL / name
    ckpt = open_checkpoint(src)
    assert not ckpt.quant.exclude_modules and any(k.endswith(".experts") for k in ckpt.quant.quantized_layers)
    census = build_census(ckpt.tensors, configured=ckpt.quant.algo_for)
    assert {str(s) for layer in census.moe for s in layer.schemes} == {"NVFP4"}
    r = cli("--json", "validate", src)
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]
    for target in ("flashinfer-cutlass", "flashinfer-trtllm", "marlin"):
        out = tmp_path / target
        assert cli("convert", src, "-o", out, "--target", target).exit_code == 0
        assert cli("verify", out).exit_code == 0


def test_a_container_entry_removed_leaves_the_experts_declared_unquantized(cli, tmp_path):
    """Without its container entry vLLM builds the MoE layer unquantized: the stored NVFP4 experts are then
    an error, as for any module the config declares unquantized."""
    src = shutil.copytree(REAL / "qwen3_moe-mixed", tmp_path / "src")
    for f, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        data = json.loads((src / f).read_text())
        data[key]["quantized_layers"].pop("model.layers.0.mlp.experts")
        (src / f).write_text(json.dumps(data))
    r = cli("--json", "validate", src)
    assert r.exit_code == 1
    assert {f["code"] for f in r.json["findings"] if f["severity"] == "error"} == {"EXC003"}
    assert all("model.layers.0.mlp.experts" in f["location"] for f in r.json["findings"])


# --- MXFP8 linears (SEMANTICS §14.2) -----------------------------------------------------------------

@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
def test_mxfp8_export_converts_and_verifies(cli, tmp_path, target):
    out = tmp_path / "o"
    assert cli("convert", REAL / "llama-mxfp8", "-o", out, "--target", target).exit_code == 0
    r = cli("--json", "verify", out)
    assert r.exit_code == 0 and {m["kind"] for m in r.json["modules"]} == {"mxfp8_linear"}
    assert all(m["kernel"] == "emulated MXFP8 (decoded layout, exact products)" for m in r.json["modules"])


def test_mxfp8_layers_below_flashinfers_minimum_are_named(cli):
    """vLLM 0.33's _check_mm_mxfp8_shape: CUTLASS/CuTe-DSL mm_mxfp8 decline N or K < 128 (a warning:
    another kernel runs them); trtllm's kernel has no minimum, only K % 256 (errors at tp 4 here)."""
    src = REAL / "llama-mxfp8"  # o_proj [256, 256], down_proj [256, 512]: K per rank 64 and 128 at tp 4
    r = cli("--json", "validate", src, "--target", "flashinfer-cutlass", "--tp", 4)
    assert r.exit_code == 0, r.json["findings"]
    assert {(f["code"], f["severity"], f["location"]) for f in r.json["findings"]} == {
        ("TGT003", "warning", f"model.layers.{i}.self_attn.o_proj") for i in (0, 1)}
    assert all("K = 64 per rank at tp 4" in f["message"] for f in r.json["findings"])
    assert cli("--json", "validate", src, "--target", "flashinfer-cutlass", "--tp", 2).json["findings"] == []
    r = cli("--json", "validate", src, "--target", "flashinfer-trtllm", "--tp", 4)
    assert {f["code"] for f in r.json["findings"]} == {"TGT001"}


QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.mark.parametrize("target,tensor,fault,says", [
    ("flashinfer-cutlass", "weight_scale", lambda t: t + 1, "weight_scale (E8M0 block scales) differs"),
    ("flashinfer-trtllm", "weight", lambda t: t.view(torch.uint8)[torch.arange(t.shape[0]).roll(1)].view(t.dtype),
     "weight differs"),
    ("flashinfer-cutlass", "weight", lambda t: (t.view(torch.uint8) ^ 1).view(t.dtype), "weight differs"),
])
def test_verify_names_a_planted_mxfp8_fault(cli, tmp_path, target, tensor, fault, says):
    out = tmp_path / "o"
    assert cli("convert", REAL / "llama-mxfp8", "-o", out, "--target", target).exit_code == 0
    edit_tensor(out, f"{QKV}.{tensor}", fault)
    r = cli("--json", "verify", out)
    failed = {m["module"]: m for m in r.json["modules"] if not m["passed"]}
    assert r.exit_code == 1 and set(failed) == {QKV} and says in failed[QKV]["message"], failed


def test_a_nan_e8m0_scale_is_refused(cli, tmp_path):
    src = shutil.copytree(REAL / "llama-mxfp8", tmp_path / "src")
    edit_tensor(src, "model.layers.1.mlp.down_proj.weight_scale", lambda t: t.index_fill_(1, torch.tensor([0]), 255))
    r = cli("--json", "validate", src, "--deep")
    assert r.exit_code == 1 and "DAT001" in {f["code"] for f in r.json["findings"]}
    r = cli("convert", src, "-o", tmp_path / "o", "--target", "flashinfer-cutlass")
    assert r.exit_code == 1 and "model.layers.1.mlp.down_proj.weight_scale" in r.stderr and "NaN" in r.stderr
    assert not (tmp_path / "o").exists()


# --- MXFP8 experts: flashinfer-trtllm only (SEMANTICS §14.3) ------------------------------------------

def test_mxfp8_moe_goes_to_trtllm(cli, tmp_path):
    src = REAL / "qwen3_moe-mxfp8"
    r = cli("--json", "validate", src, "--target", "flashinfer-cutlass")
    moe = [f for f in r.json["findings"] if f["location"].endswith(".experts")]
    assert r.exit_code == 1 and moe and all(f["code"] == "TGT002" and "--target flashinfer-trtllm" in f["hint"] for f in moe)
    out = tmp_path / "o"
    assert cli("convert", src, "-o", out, "--target", "flashinfer-trtllm").exit_code == 0
    r = cli("--json", "verify", out)
    assert r.exit_code == 0 and {m["kind"] for m in r.json["modules"]} == {"mxfp8_linear", "mxfp8_moe"}


@pytest.fixture(scope="module")
def odd_mxfp8_moe(tmp_path_factory):
    """MXFP8 experts beside BF16 attention, H = 320, I = 192: trtllm pads H to 512 and I to 256 (128 at tp 2)."""
    from fixtures.generate import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("mx8") / "src", arch="qwen3_moe", algo="MIXED_PRECISION",
                           mixed={"mlp.experts": "MXFP8"}, hidden=320, heads=5, kv_heads=1, head_dim=64, moe_intermediate=192)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_padded_mxfp8_moe_converts_and_verifies(cli, tmp_path, odd_mxfp8_moe, tp, ep):
    out = tmp_path / "o"
    assert cli("convert", odd_mxfp8_moe, "-o", out, "--target", "flashinfer-trtllm", "--tp", tp, "--ep", ep).exit_code == 0
    manifest = json.loads((out / "mocli-layout.json").read_text())
    metas = [m["meta"] for r in manifest.get("ranks") or [{"modules": manifest["modules"]}] for m in r["modules"]]
    assert {(m["padded_intermediate"], m["padded_hidden"]) for m in metas} == {(256 if ep > 1 or tp == 1 else 128, 512)}
    r = cli("--json", "verify", out)
    assert r.exit_code == 0, [m["message"] for m in r.json["modules"] if not m["passed"]]


E0 = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("tensor,fault,says", [
    ("w13_weight_scale", lambda t: t.index_fill_(2, torch.tensor([t.shape[2] - 1]), 126), "padding is not zero weights and 127"),
    # the halves swapped: padding rows (I = 192 of Ip = 256 each) land among the data rows
    ("w13_weight", lambda t: torch.cat([t[:, t.shape[1] // 2:], t[:, :t.shape[1] // 2]], dim=1), "padding is not zero"),
    ("w2_weight", lambda t: t.view(torch.uint8).index_put_((torch.arange(t.shape[0]), torch.zeros(t.shape[0], dtype=torch.long),
                                                           torch.zeros(t.shape[0], dtype=torch.long)),
                                                          torch.tensor(0x11, dtype=torch.uint8)).view(t.dtype), "differs"),
    ("w2_weight_scale", lambda t: torch.where(t == 127, t, t + 1), "w2_weight_scale (expert 0) differs"),
])
def test_verify_names_a_planted_mxfp8_moe_fault(cli, tmp_path, odd_mxfp8_moe, tensor, fault, says):
    out = tmp_path / "o"
    assert cli("convert", odd_mxfp8_moe, "-o", out, "--target", "flashinfer-trtllm").exit_code == 0
    edit_tensor(out, f"{E0}.{tensor}", fault)
    r = cli("--json", "verify", out)
    failed = {m["module"]: m for m in r.json["modules"] if not m["passed"]}
    assert r.exit_code == 1 and set(failed) == {E0} and says in failed[E0]["message"], failed


def test_config_json_exclude_modules_is_read_where_ignore_is_absent():
    """vLLM 0.33 reads config.json's ``ignore``, else ``exclude_modules`` (ModelOpt exports used both)."""
    q = {"quant_method": "modelopt", "quant_algo": "FP8"}
    for key, want in (("ignore", ["lm_head"]), ("exclude_modules", ["lm_head"])):
        findings = Findings()
        assert parse_config_json({"quantization_config": {**q, key: ["lm_head"]}}, findings).exclude_modules == want
        assert not findings
    both = parse_config_json({"quantization_config": {**q, "ignore": ["a"], "exclude_modules": ["b"]}}, Findings())
    assert both.exclude_modules == ["a"]  # ignore first, as vLLM


# --- NVFP4_AWQ (SEMANTICS §15; synthetic exports: no real one was made here) ----------------------------

@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    from fixtures.generate import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("awq") / "src", arch="qwen3_moe", algo="NVFP4_AWQ")


@pytest.mark.parametrize("target,tp,ep", [("flashinfer-cutlass", 1, 1), ("flashinfer-trtllm", 1, 1),
                                          ("flashinfer-cutlass", 2, 1), ("flashinfer-cutlass", 2, 2)])
def test_awq_converts_with_its_pre_quant_scales(cli, tmp_path, awq, target, tp, ep):
    out = tmp_path / "o"
    assert cli("convert", awq, "-o", out, "--target", target, "--tp", tp, "--ep", ep).exit_code == 0
    manifest = json.loads((out / "mocli-layout.json").read_text())
    ranks = manifest.get("ranks") or [{"modules": manifest["modules"], "tensors": manifest["tensors"]}]
    for r in ranks:
        held = {m["name"]: m["tensors"].get("pre_quant_scale") for m in r["modules"]}
        assert all(held[n] for n in held if n.endswith(("o_proj", "experts"))), held
        assert not any(held[n] for n in held if n.endswith(("qkv_proj",))), held
        o_proj = r["tensors"]["model.layers.0.self_attn.o_proj.pre_quant_scale"]
        assert o_proj["dtype"] == "BF16" and o_proj["shape"] == [128 // tp]  # row-parallel: K sliced
    assert cli("verify", out).exit_code == 0


def test_verify_names_a_wrong_pre_quant_scale(cli, tmp_path, awq):
    out = tmp_path / "o"
    assert cli("convert", awq, "-o", out, "--target", "flashinfer-cutlass").exit_code == 0
    edit_tensor(out, "model.layers.1.self_attn.o_proj.pre_quant_scale", lambda t: t * 2)
    r = cli("--json", "verify", out)
    failed = {m["module"]: m["message"] for m in r.json["modules"] if not m["passed"]}
    assert r.exit_code == 1 and set(failed) == {"model.layers.1.self_attn.o_proj"}
    assert "pre_quant_scale (BF16) differs" in failed["model.layers.1.self_attn.o_proj"]


def test_experts_smoothed_apart_are_refused(cli, tmp_path, awq):
    src = shutil.copytree(awq, tmp_path / "src")
    edit_tensor(src, "model.layers.0.mlp.experts.1.gate_proj.pre_quant_scale", lambda t: t * 1.5)
    r = cli("convert", src, "-o", tmp_path / "o", "--target", "flashinfer-cutlass")
    assert r.exit_code == 1 and "AWQ001" in r.stderr and "experts.1.gate_proj" in r.stderr


# --- real ModelOpt 0.47 exports calibrated on the H200: NVFP4_AWQ (Llama) and four-over-six ---------------

def test_real_awq_export(cli, tmp_path):
    """ModelOpt kept pre_quant_scale on o_proj only (BF16 [K]: q/k/v and gate/up were folded into the norms;
    this confirms SEMANTICS §15.1's unconfirmed dtype) and wrote no config_groups."""
    src = REAL / "llama-nvfp4_awq"
    r = cli("--json", "validate", src, "--engine", "all")
    assert r.exit_code == 0 and {f["code"] for f in r.json["findings"]} == {"VLL001"}
    ckpt = open_checkpoint(src)
    kept = sorted(n for n in ckpt.tensors if n.endswith(".pre_quant_scale"))
    assert kept == [f"model.layers.{i}.self_attn.o_proj.pre_quant_scale" for i in range(2)]
    assert {ckpt.tensors[n].dtype for n in kept} == {"BF16"}
    for target, tp in (("flashinfer-cutlass", 1), ("flashinfer-trtllm", 1), ("flashinfer-cutlass", 2)):
        out = tmp_path / f"{target}-{tp}"
        assert cli("convert", src, "-o", out, "--target", target, "--tp", tp).exit_code == 0
        assert cli("verify", out).exit_code == 0
    r = cli("--json", "validate", src, "--target", "marlin")
    assert r.exit_code == 1 and {f["code"] for f in r.json["findings"] if f["severity"] == "error"} == {"TGT002"}


@pytest.mark.parametrize("name", ["llama-nvfp4_four_over_six", "qwen3_moe-nvfp4_four_over_six"])
def test_real_four_over_six_export(cli, tmp_path, name):
    """NVFP4_FOUR_OVER_SIX_CFG exports plain NVFP4 whose block scales reach 384 (not 448): read as NVFP4,
    converted for every target, verified within the NVFP4 thresholds (measured: exact, 2.7e-7)."""
    from safetensors.torch import load_file

    src = REAL / name
    tensors = load_file(str(src / "model.safetensors"))
    top = max(float(v.float().max()) for k, v in tensors.items() if k.endswith(".weight_scale"))
    assert top == 384.0
    r = cli("--json", "validate", src, "--engine", "all")
    assert r.exit_code == 0 and r.json["findings"] == []
    for target in ("flashinfer-cutlass", "flashinfer-trtllm", "marlin"):
        out = tmp_path / target
        assert cli("convert", src, "-o", out, "--target", target).exit_code == 0
        r = cli("--json", "verify", out)
        assert r.exit_code == 0 and max(m["error"] for m in r.json["modules"]) < 1e-3


def test_mixed_mxfp8_and_w4a16_converts_for_marlin(cli, tmp_path):
    """ModelOpt 0.47's llama-mixed (MXFP8 attention, W4A16_NVFP4 MLP): the FlashInfer targets have no W4A16
    path, so marlin (Hopper) takes it whole, its MXFP8 linears in flashinfer-cutlass's layout."""
    src = REAL / "llama-mixed"
    assert cli("validate", src, "--target", "flashinfer-cutlass").exit_code == 1
    out = tmp_path / "o"
    assert cli("convert", src, "-o", out, "--target", "marlin", "--tp", 2).exit_code == 0
    r = cli("--json", "verify", out)
    assert r.exit_code == 0 and {m["kind"] for m in r.json["modules"]} == {"mxfp8_linear", "nvfp4_marlin_linear"}
