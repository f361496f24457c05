"""Name tables, as data. Each entry names the upstream code it mirrors."""

from __future__ import annotations

from dataclasses import dataclass

# Engine fused parameter -> checkpoint shards, in concatenation order.
# vLLM `packed_modules_mapping` (models/llama.py, qwen2.py, qwen3_moe.py, deepseek_v2.py).
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
SHARD_TO_FUSED: dict[str, str] = {s: fused for fused, shards in FUSED_GROUPS.items() for s in shards}


@dataclass(frozen=True)
class ExpertNaming:
    """How one model family names its per-expert projections."""

    style: str
    container: str  # the part of the prefix before ".<e>."
    gate: str  # w1: input of the activation
    up: str  # w3: multiplied with act(gate)
    down: str  # w2
    # gate and up in one per-expert tensor, rows interleaved (row 2i gate_i, 2i+1 up_i): gpt-oss's layout, which
    # AMD Quark keeps per expert and mocli's gpt-oss reader presents per expert (vllm 0.33 models/gpt_oss.py,
    # layers/activation.py :: SwigluOAIAndMul; SEMANTICS §19.2)
    gate_up: str = ""


EXPERT_NAMINGS: tuple[ExpertNaming, ...] = (
    # transformers MixtralSparseMoeBlock; vLLM models/mixtral.py expert_params_mapping
    ExpertNaming("mixtral", "block_sparse_moe.experts", gate="w1", up="w3", down="w2"),
    # transformers Qwen2/Qwen3-MoE and DeepSeek-V2/V3 MLP experts; gpt-oss's (GptOssExperts) too
    ExpertNaming("qwen", "mlp.experts", gate="gate_proj", up="up_proj", down="down_proj", gate_up="gate_up_proj"),
)

# Suffixes of the tensors that belong to one quantized linear (SEMANTICS §1 table).
WEIGHT = "weight"
WEIGHT_SCALE = "weight_scale"
WEIGHT_SCALE_2 = "weight_scale_2"
INPUT_SCALE = "input_scale"
PRE_QUANT_SCALE = "pre_quant_scale"  # NVFP4_AWQ's per-input-channel activation multiplier (SEMANTICS §15)
SCALE_SUFFIXES = frozenset({WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE})
# KV-cache scales hang off k_proj / v_proj (ModelOpt FP8_KV_CFG export).
KV_SUFFIXES = frozenset({"k_scale", "v_scale"})

# Last name components of 2-D weights the engine does not build as quantizable linears
# (vLLM VocabParallelEmbedding / ParallelLMHead are not LinearBase).
NON_LINEAR_NAMES = frozenset({"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out"})

# Architectures whose MoE router (``<layer>.gate``, beside the experts) vLLM 0.33 builds with the quantization
# config (``GateLinear(..., quant_config=...)``: models/qwen3_moe.py, k2_horizon.py, lfm2_moe.py). Every other
# model's router is built without one (mixtral.py, qwen2_moe.py, deepseek_v2.py, glm4_moe.py, ...): it stays
# unquantized whatever the exclusion list says.
ROUTER_TAKES_QUANT_CONFIG = frozenset({"Qwen3MoeForCausalLM", "K2HorizonForCausalLM", "Lfm2MoeForCausalLM"})

# VLM prefixes that engines and exporters spell differently (SEMANTICS §2, vLLM hf_to_vllm_mapper).
VLM_PREFIX_ALIASES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model.language_model."),
    ("model.language_model.", "language_model.model."),
    ("language_model.", ""),
)
