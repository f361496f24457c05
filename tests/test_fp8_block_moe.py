"""FP8 128x128-block experts (SEMANTICS §18): llm-compressor's FP8_BLOCK (compressed-tensors) and vLLM's own block
fp8 (``weight_block_size``, ``weight_scale_inv``) converted for both FlashInfer targets, byte for byte against
tests/reference.py's restatement of vLLM 0.33's ``prepare_fp8_moe_layer_for_fi`` ([w3; w1], scales clamped to
1e-10; trtllm's 16-row shuffle and BlockMajorK as ``_shuffle_deepseek_fp8_moe_weights`` writes them); verify
catches the faults that layout invites; what no target takes is refused with its reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.native_fp8 import make_native_fp8_block
from tests import reference as ref
from tests.conftest import REAL, edit_tensor

CUTLASS, TRTLLM = "flashinfer-cutlass", "flashinfer-trtllm"
CT_BLOCK = REAL / "qwen3_moe-ct-fp8_block"


def _load(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        out |= {f"{f.parent.relative_to(d)}/{k}": v for k, v in load_file(str(f)).items()}
    return out


def _source(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _scale(src, m: str) -> torch.Tensor:
    s = src.get(m + ".weight_scale", src.get(m + ".weight_scale_inv"))
    return s.float().reshape(-1, s.shape[-1]).clamp(min=1e-10)


def _expected(src, layer: str, experts: range, i: tuple[int, int], target: str) -> dict[str, torch.Tensor]:
    """The rank's four tensors from the source by the restatement (w13 rows [up; gate] of the rank's I)."""
    i0, i1 = i
    w13 = torch.stack([torch.cat([src[f"{layer}.{e}.up_proj.weight"][i0:i1], src[f"{layer}.{e}.gate_proj.weight"][i0:i1]])
                       for e in experts]).view(torch.uint8)
    w2 = torch.stack([src[f"{layer}.{e}.down_proj.weight"][:, i0:i1] for e in experts]).view(torch.uint8)
    if target == TRTLLM:
        w13, w2 = ref.deepseek_block_major(w13.contiguous()), ref.deepseek_block_major(w2.contiguous())
    b0, b1 = i0 // 128, i1 // 128
    s13 = torch.stack([torch.cat([_scale(src, f"{layer}.{e}.up_proj")[b0:b1], _scale(src, f"{layer}.{e}.gate_proj")[b0:b1]])
                       for e in experts])
    s2 = torch.stack([_scale(src, f"{layer}.{e}.down_proj")[:, b0:b1] for e in experts])
    return {"w13_weight": w13, "w2_weight": w2, "w13_weight_scale": s13, "w2_weight_scale": s2}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """vLLM's own block fp8, an MoE whose attention splits into whole 128-row blocks at tp 2."""
    return make_native_fp8_block(tmp_path_factory.mktemp("native") / "m", arch="qwen3_moe", hidden=256, heads=4,
                                 kv_heads=4, head_dim=64)


@pytest.mark.parametrize("target", [CUTLASS, TRTLLM])
@pytest.mark.parametrize("which,tp,ep", [("ct", 1, 1), ("native", 1, 1), ("native", 2, 2)])
def test_block_experts_are_what_vllm_prepares(cli, tmp_path, native, which, tp, ep, target):
    src_dir = CT_BLOCK if which == "ct" else native
    out = tmp_path / "o"
    assert cli("convert", src_dir, "-o", out, "--target", target, "--tp", tp, "--ep", ep).exit_code == 0
    src, got = _source(src_dir), _load(out)
    manifest = json.loads((out / "mocli-layout.json").read_text())
    ranks = manifest.get("ranks") or [{"dir": "."}]
    experts_total = 8 if which == "ct" else 4
    for r, rank in enumerate(ranks):
        per = experts_total // ep
        e0 = r * per if ep > 1 else 0
        for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
            want = _expected(src, layer, range(e0, e0 + per), (0, 128), target)
            for role, t in want.items():
                stored = got[f"{rank['dir']}/{layer}.{role}"]
                assert stored.shape == t.shape, (role, stored.shape, t.shape)
                assert torch.equal(stored.view(torch.uint8) if role.endswith("_weight") else stored, t), (r, layer, role)
    assert cli("verify", out).exit_code == 0


def test_dead_experts_block_scales_are_clamped(cli, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(CT_BLOCK, d)
    t = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale"
    t[name] = torch.full_like(t[name], 1e-23)  # a dead expert's near-zero scales (vLLM's comment: ~1e-23)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "o"
    assert cli("convert", d, "-o", out, "--target", CUTLASS).exit_code == 0
    s = _load(out)["./model.layers.1.mlp.experts.w2_weight_scale"][5]
    assert (s == torch.tensor(1e-10, dtype=torch.float32)).all()
    assert cli("verify", out).exit_code == 0


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    half = w.shape[1] // 2
    return torch.cat([w[:, half:], w[:, :half]], dim=1).contiguous()


@pytest.mark.parametrize("target,role,fault", [
    (CUTLASS, "w13_weight", _swap_halves),  # [w1; w3]: FlashInfer would gate the wrong half
    (CUTLASS, "w13_weight_scale", _swap_halves),
    (CUTLASS, "w2_weight_scale", lambda s: s * 2),
    (TRTLLM, "w2_weight", lambda w: w.view(torch.uint8).flip(2).contiguous().view(w.dtype)),  # a wrong shuffle
])
def test_verify_catches_block_layout_faults(cli, tmp_path, target, role, fault):
    out = tmp_path / "o"
    assert cli("convert", CT_BLOCK, "-o", out, "--target", target).exit_code == 0
    edit_tensor(out, f"model.layers.0.mlp.experts.{role}", fault)
    r = cli("--json", "verify", out)
    assert r.exit_code == 1
    assert {m["module"] for m in r.json["modules"] if not m["passed"]} == {"model.layers.0.mlp.experts"}


def test_split_block_rows_and_per_channel_experts_are_refused(cli):
    # I = 128 over tp 2 is 64 rows per rank: vLLM's validate_fp8_block_shape_moe refuses it
    r = cli("--json", "validate", CT_BLOCK, "--target", TRTLLM, "--tp", "2")
    assert any(f["code"] == "TGT001" and "2I = 128" in f["message"] for f in r.json["findings"]), r.json["findings"]
    r = cli("--json", "validate", REAL / "qwen3_moe-ct-fp8_dynamic", "--target", CUTLASS)
    f = [f for f in r.json["findings"] if f["code"] == "TGT002"]
    assert f and all("no FlashInfer path" in x["hint"] for x in f)


@pytest.mark.parametrize("edit,code", [
    (lambda q: q.__setitem__("activation_scheme", "static"), "CFG002"),
    (lambda q: q.__setitem__("weight_block_size", [64, 64]), "CFG003"),
])
def test_native_block_config_errors(cli, tmp_path, native, edit, code):
    d = tmp_path / "m"
    shutil.copytree(native, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))
    assert code in [f["code"] for f in cli("--json", "validate", d).json["findings"]]


def test_native_block_reads_ignored_layers_before_modules_to_not_convert(cli, tmp_path, native):
    d = tmp_path / "m"
    shutil.copytree(native, d)
    cfg = json.loads((d / "config.json").read_text())
    q = cfg["quantization_config"]
    q["ignored_layers"], q["modules_to_not_convert"] = q["modules_to_not_convert"], ["nothing"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert cli("--json", "validate", d).json["findings"] == []
    q["ignored_layers"] = []  # empty: vLLM falls back to modules_to_not_convert, which misses the gates
    (d / "config.json").write_text(json.dumps(cfg))
    assert "EXC004" in [f["code"] for f in cli("--json", "validate", d).json["findings"]]


@pytest.mark.parametrize("arch,flagged", [("mixtral", False), ("qwen3_moe", True)])
def test_routers_follow_whether_the_model_quantizes_them(cli, tmp_path, arch, flagged):
    """vLLM 0.33 builds Mixtral's (and DeepSeek's, Qwen2-MoE's, ...) router without the quantization config, and
    Qwen3-MoE's with it: an unlisted BF16 router is fine in the first and EXC004 in the second."""
    d = make_native_fp8_block(tmp_path / arch, arch=arch, hidden=256, heads=4, kv_heads=4, head_dim=64,
                              intermediate=128)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (d / "config.json").write_text(json.dumps(cfg))
    codes = [f["code"] for f in cli("--json", "validate", d).json["findings"]]
    assert ("EXC004" in codes) is flagged and set(codes) <= {"EXC004"}, codes
