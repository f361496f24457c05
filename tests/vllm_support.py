"""Helpers for tests/test_vllm.py: vLLM engines on converted directories, the independent BF16
reference, logprob comparison and planted layout faults. Imports vLLM only inside functions.

The reference path shares no code with the plugin or the converter: the *source* checkpoint is
dequantized here with its own scales (tests/reference.py for NVFP4, the one-line FP8 rules of
SEMANTICS §1 below) into a plain BF16 checkpoint, which stock vLLM serves with no plugin code on
its path.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.reference import dequant_nvfp4, unpack_fp4

# Teacher-forced token ids: every position's full next-token distribution is compared (prompt
# logprobs), so a near-tie cannot make two runs walk different sequences. Ids < 64 (the generated
# fixtures' vocabulary).
PROMPT = [1, 5, 17, 42, 9, 7, 3, 30, 12, 61, 2, 44, 8, 19, 33, 50, 27, 6, 58, 14, 40, 11, 25, 36]
GEN_PROMPTS = [[1, 5, 17, 42, 9, 7], [3, 30, 12, 61, 2]]
GEN_TOKENS = 6
MAX_LEN = 128  # the real exports' max_position_embeddings

# one core per rank on the 2-core machines (research §0: "auto" cannot bind 2 workers on one NUMA node)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@dataclass
class Run:
    """What one engine produced: full-vocabulary log-softmax at every prompt position, greedy tokens."""

    logprobs: torch.Tensor  # float64 [len(PROMPT) - 1, V]
    tokens: list[list[int]]
    margins: list[list[float]]  # per generated token: its logprob minus the runner-up's
    start_s: float  # LLM(...) construction, seconds

    def distance(self, other: Run) -> float:
        """Largest absolute logprob difference over every position and token."""
        return float((self.logprobs - other.logprobs).abs().max())

    def spread(self) -> float:
        """Standard deviation of the logprobs around each position's mean: the size of the signal."""
        return float((self.logprobs - self.logprobs.mean(dim=1, keepdim=True)).std())


@contextlib.contextmanager
def engine_env(**extra: str):
    old = {k: os.environ.get(k) for k in {**ENGINE_ENV, **extra}}
    os.environ.update({**ENGINE_ENV, **extra})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_engine(model: Path, tp: int = 1, ep: bool = False, kv_cache_dtype: str = "bfloat16", eager: bool = True,
               **kw) -> Run:
    """One vLLM engine (in-process at tp = 1, spawned workers at tp > 1), prompt logprobs over PROMPT and
    greedy generation from GEN_PROMPTS, then torn down. ``eager=False``: vLLM's default torch.compile."""
    with engine_env():
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=eager,
                  max_model_len=MAX_LEN, kv_cache_memory_bytes=1 << 27, max_logprobs=-1, seed=0,
                  tensor_parallel_size=tp, enable_expert_parallel=ep, kv_cache_dtype=kv_cache_dtype, **kw)
        start = time.perf_counter() - t0
        try:
            plp = llm.generate([{"prompt_token_ids": PROMPT}],
                               SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False), use_tqdm=False)
            gen = llm.generate([{"prompt_token_ids": p} for p in GEN_PROMPTS],
                               SamplingParams(temperature=0, max_tokens=GEN_TOKENS, logprobs=2, detokenize=False),
                               use_tqdm=False)
        finally:
            shutdown(llm)
    rows = plp[0].prompt_logprobs[1:]
    vocab = len(rows[0])
    lp = torch.full((len(rows), vocab), float("nan"), dtype=torch.float64)
    for i, row in enumerate(rows):
        for tok, v in row.items():
            lp[i, tok] = v.logprob
    margins = [[_margin(step) for step in o.outputs[0].logprobs] for o in gen]
    return Run(lp, [list(o.outputs[0].token_ids) for o in gen], margins, start)


def _margin(step: dict) -> float:
    top = sorted((v.logprob for v in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def shutdown(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup()


def cleanup() -> None:
    """Tear down what an engine left in this process (also after a failed start: the next engine
    would otherwise find the last one's parallel groups)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def engine_error(model: Path, **kw) -> BaseException:
    """The error an in-process engine raises for ``model`` (AssertionError if it starts)."""
    with engine_env():
        from vllm import LLM

        try:
            llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, max_model_len=MAX_LEN,
                      kv_cache_memory_bytes=1 << 27, **kw)
        except Exception as e:  # noqa: BLE001 - any failure is the result
            cleanup()
            return e
        shutdown(llm)
    raise AssertionError(f"vLLM served {model}")


# --- what vLLM's CPU build runs on its own path, on this CPU -------------------------------------------
# A test that serves a *source* on vLLM's own path (not mocli's plugin) skips where the CPU build cannot run its
# scheme, decided by vLLM's own probes (mocli.vllm_plugin.cpu_isa: MOCLI_CPU_ISA answers as another CPU would).

def cpu_build_cannot_run(need: str) -> str | None:
    """Why vLLM 0.32's CPU build cannot run ``need`` on this CPU (None: it can)."""
    from mocli.vllm_plugin import cpu_isa

    isa = cpu_isa.cpu_isa()
    if need == "fp8_kv":  # v1/attention/backends/cpu_attn.py :: _get_attn_isa
        return None if cpu_isa.fp8_kv_cache_runs(isa) else f"{cpu_isa.FP8_KV_RULE}; {isa.describe()}"
    if need == "fp8_block":  # model_executor/kernels/linear/scaled_mm/cpu.py :: CPUFp8BlockScaledMMKernel.is_supported
        import vllm._custom_ops as ops

        ok = isa.amx and bool(getattr(ops, "_supports_cpu_fp8_w8a16", False))
        return None if ok else f"vLLM's CPU build runs FP8 block GEMMs only with AMX (and fp8_scaled_mm_cpu); {isa.describe()}"
    if need == "fp8_static":  # fusion/fused_act_quant.py :: _silu_and_mul_fp8_static; the static quant op itself
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

        missing = [f"_C.{op}" for op in ("silu_and_mul_quant", "static_scaled_fp8_quant") if not _c_op_takes_args(op)]
        return (f"this vLLM CPU wheel has no working {' or '.join(missing)}: FP8 static activations do not run"
                if missing else None)
    raise KeyError(need)


def _c_op_takes_args(op: str) -> bool:
    """torch.ops._C.<op> exists and is not an argument-less stub (vllm-cpu 0.32.0 registers several FP8 ops so)."""
    try:
        return bool(getattr(torch.ops._C, op).default._schema.arguments)
    except (AttributeError, RuntimeError):
        return False


def vllm_path_needs(src: Path, kv_cache_dtype: str = "auto") -> list[str]:
    """What serving ``src`` (a ModelOpt or compressed-tensors source) on vLLM's own path needs of the CPU build
    (cpu_build_cannot_run's names), read from its config as vLLM reads it."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    q = cfg.get("quantization_config") or {}
    hf = Path(src) / "hf_quant_config.json"
    mo = json.loads(hf.read_text()).get("quantization", {}) if hf.is_file() else q
    needs = set()
    kv = mo.get("kv_cache_quant_algo") or q.get("kv_cache_scheme")
    if kv_cache_dtype.startswith("fp8") or (kv_cache_dtype == "auto" and (
            str(kv).upper() == "FP8" or (isinstance(kv, dict) and kv.get("num_bits") == 8))):
        needs.add("fp8_kv")
    if q.get("quant_method") == "compressed-tensors":
        for g in (q.get("config_groups") or {}).values():
            w, a = g.get("weights") or {}, g.get("input_activations") or {}
            if w.get("strategy") == "block":
                needs.add("fp8_block")
            if a.get("num_bits") == 8 and a.get("type") == "float" and not a.get("dynamic"):
                needs.add("fp8_static")
    else:
        algos = {str(mo.get("quant_algo", "")).upper()} | {str(v.get("quant_algo", "")).upper()
                                                           for v in (mo.get("quantized_layers") or {}).values()}
        needs |= {"fp8_static"} if "FP8" in algos else set()
        needs |= {"fp8_block"} if "FP8_PB_WO" in algos else set()
    return sorted(needs)


def skip_unless_cpu_build_runs(src: Path, kv_cache_dtype: str = "auto") -> None:
    import pytest

    reasons = [r for n in vllm_path_needs(src, kv_cache_dtype) if (r := cpu_build_cannot_run(n))]
    if reasons:
        pytest.skip(f"vLLM's own path on {Path(src).name}: " + "; ".join(reasons))


# --- the independent reference: the source dequantized with its own scales -------------------------

def _dequant(t: dict[str, torch.Tensor], m: str) -> torch.Tensor:
    """float32 [N, K] of source module ``m`` (SEMANTICS §1: w = q * scale)."""
    w, s = t[m + ".weight"], t[m + ".weight_scale"].float()
    if w.dtype == torch.uint8 and t[m + ".weight_scale"].dtype == torch.uint8:  # MXFP4: e2m1 * 2^(code - 127) per 32
        return unpack_fp4(w) * torch.exp2(s - 127).repeat_interleave(32, 1)
    if w.dtype == torch.uint8:  # NVFP4: e2m1 * (block scale * weight_scale_2)
        return dequant_nvfp4(w, t[m + ".weight_scale"], float(t[m + ".weight_scale_2"]))
    q = w.float()
    if t[m + ".weight_scale"].dtype == torch.uint8:  # MXFP8: E8M0 exponents per 32 along K
        return q * torch.exp2(s - 127).repeat_interleave(32, 1)
    if s.numel() == 1:  # FP8 per tensor (ModelOpt 0-dim, compressed-tensors [1])
        return q * s.reshape(())
    if s.numel() == q.shape[0]:  # FP8 per channel
        return q * s.reshape(-1, 1)
    blocks = s.reshape(-(-q.shape[0] // 128), -(-q.shape[1] // 128))  # FP8 128x128 blocks (the last may be partial)
    return q * blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]


def _modelopt_names(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors' NVFP4 spelling (SEMANTICS §17.1) in ModelOpt's: ``weight_packed`` is the weight and
    the global scales are divisors (weight_scale_2 = 1 / weight_global_scale, in float32); vLLM's block fp8
    ``weight_scale_inv`` is the ``weight_scale``."""
    out = {}
    for name, v in t.items():
        m, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            out[f"{m}.weight"] = v
        elif suffix == "weight_scale_inv":  # vLLM's own block fp8: a dequant scale despite the name
            out[f"{m}.weight_scale"] = v
        elif suffix == "weight_global_scale":
            out[f"{m}.weight_scale_2"] = torch.reciprocal(v.float()).reshape(())
        elif suffix != "input_global_scale":
            out[name] = v
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """A BF16 checkpoint whose every quantized linear is the source's, dequantized; scales and KV-cache
    scales dropped; config.json without quantization_config."""
    t: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        t |= load_file(str(f))
    t = _modelopt_names(t)
    scales = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale", ".pre_quant_scale")
    out = {}
    for name, v in t.items():
        if name.endswith(scales):
            continue
        m = name.removesuffix(".weight")
        w = _dequant(t, m) if name.endswith(".weight") and m + ".weight_scale" in t else v.float()
        if m + ".pre_quant_scale" in t and name.endswith(".weight"):  # NVFP4_AWQ: W (x * s) = (W diag s) x
            w = w * t[m + ".pre_quant_scale"].float()
        out[name] = w.to(torch.bfloat16).contiguous()
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# --- planted layout faults ------------------------------------------------------------------------

def edit_tensor(out: Path, name: str, fn) -> None:
    """Rewrite one tensor of a converted directory in place (same dtype and shape, same shard), as a
    damaged or wrongly converted file would carry it; the manifest and index are left as they were."""
    for shard in sorted(Path(out).rglob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if name not in f.keys():
                continue
            meta = f.metadata()
        tensors = load_file(str(shard))
        new = fn(tensors[name].clone())
        assert new.dtype == tensors[name].dtype and new.shape == tensors[name].shape
        tensors[name] = new.contiguous()
        save_file(tensors, str(shard), metadata=meta)
        return
    raise KeyError(name)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with each expert's [w3; w1] rows turned into [w1; w3]."""
    half = t.shape[1] // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


def natural_order_scales(t: torch.Tensor) -> torch.Tensor:
    """An NVFP4 block-scale matrix whose 128x4 interleave was never applied: the bytes of the natural
    [M, K/16] matrix where the swizzled ones belong (shapes without padding only)."""
    from tests.reference import unswizzle_by_offsets

    m, kb = t.shape
    return unswizzle_by_offsets(t.view(torch.uint8), m, kb).view(t.dtype).reshape(m, kb)


# --- test models ----------------------------------------------------------------------------------

def edit_source(src: Path, fn) -> Path:
    """Apply ``fn`` to the tensors of a one-file source checkpoint, in place."""
    path = Path(src) / "model.safetensors"
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path), metadata={"format": "pt"})
    return src


def add_qk_norms(head_dim: int = 64):
    """Qwen3 attention has q_norm/k_norm ([head_dim] weights); the generated fixture omits them, which vLLM
    (stock and mocli's loader alike) refuses. Ones, as a fresh Hugging Face model has them."""
    def fn(t: dict[str, torch.Tensor]) -> None:
        for lp in {n.split(".self_attn.")[0] for n in t if ".self_attn.o_proj." in n}:
            for norm in ("q_norm", "k_norm"):
                t[f"{lp}.self_attn.{norm}.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
    return fn


def amplify_experts(factor: float):
    """Scale every expert's down projection (w2 / down_proj) by ``factor`` through its per-tensor weight
    scale (FP8 weight_scale, NVFP4 weight_scale_2). The random fixtures' experts add about a tenth of
    the residual stream, too little for an end-to-end comparison to see a fault in them; scaled up,
    the MoE output dominates. Only GEMM2's *output* grows: no activation quantizer sees a new range."""
    def fn(t: dict[str, torch.Tensor]) -> None:
        for n in list(t):
            if ".experts." in n and (".w2." in n or ".down_proj." in n):
                if n.endswith(".weight_scale_2") or (n.endswith(".weight_scale") and t[n].dim() == 0):
                    t[n] = t[n] * factor
    return fn


# --- agreement ------------------------------------------------------------------------------------
# Measured on the models of tests/test_vllm.py (relative rms = rms of the logprob difference over every
# position and vocabulary entry, divided by Run.spread() of the reference, about 0.24-0.31 here):
#   plugin vs BF16 source reference: FP8 per-tensor 0.050-0.063, per-channel 0.035, 128x128 blocks
#   0.032, FP8 MoE 0.045-0.048; NVFP4 dense 0.13, NVFP4 MoE 0.12-0.19
#   flashinfer-cutlass vs flashinfer-trtllm, same parallel layout: 0.0 (bit-identical)
#   tp 2 and tp 2 x ep 2 vs tp 1: FP8 0.020-0.034, NVFP4 0.046-0.090
#   marlin (weight-only: BF16 activations on both sides) vs BF16 source reference 0.006-0.008 at tp 1, tp 2
#   and tp 2 x ep 2, W4A16 and NVFP4 sources alike
FORMAT_TOLERANCE = {"fp8": 0.10, "nvfp4": 0.30, "w4a16": 0.03, "mxfp4": 0.03}
PARALLEL_TOLERANCE = {"fp8": 0.08, "nvfp4": 0.20, "w4a16": 0.03, "mxfp4": 0.03}
TIE_MARGIN = 0.1  # greedy steps whose top-2 logprobs are closer than this may legitimately differ


def relative_rms(run: Run, ref: Run) -> float:
    d = run.logprobs - ref.logprobs
    return float(d.pow(2).mean().sqrt()) / ref.spread()


def tokens_agree(a: Run, b: Run) -> bool:
    """Greedy tokens equal, up to the first step where ``a``'s top two are within TIE_MARGIN."""
    for ta, tb, margins in zip(a.tokens, b.tokens, a.margins, strict=True):
        for x, y, m in zip(ta, tb, margins, strict=True):
            if m < TIE_MARGIN:
                break
            if x != y:
                return False
    return True


def disagreements(run: Run, *, reference: Run, fmt: str, same_layout: dict[str, Run] | None = None,
                  other_parallel: dict[str, Run] | None = None) -> list[str]:
    """Every way ``run`` disagrees: with the source reference beyond the format's rounding; with another
    target at the same parallel layout at all (same decoded weights, same emulated math: bit-identical);
    with another parallel layout beyond the format's PARALLEL_TOLERANCE or in its greedy tokens."""
    out = []
    if not bool(torch.isfinite(run.logprobs).all()):
        out.append("logprobs are not finite")
    rel = relative_rms(run, reference)
    if not rel <= FORMAT_TOLERANCE[fmt]:
        out.append(f"source reference: relative rms {rel:.3f} > {FORMAT_TOLERANCE[fmt]} ({fmt} rounding)")
    for name, other in (same_layout or {}).items():
        if not torch.equal(run.logprobs, other.logprobs) or run.tokens != other.tokens:
            out.append(f"{name}: differs (max |d logprob| {run.distance(other):.3g}), the layouts decode to the "
                       "same weights")
    for name, other in (other_parallel or {}).items():
        rel = relative_rms(run, other)
        if not rel <= PARALLEL_TOLERANCE[fmt]:
            out.append(f"{name}: relative rms {rel:.3f} > {PARALLEL_TOLERANCE[fmt]}")
        if not tokens_agree(other, run):
            out.append(f"{name}: greedy tokens differ before any near-tie ({other.tokens} vs {run.tokens})")
    return out


def safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files directly in ``d``."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    return out


def layout_ranks(out: Path):
    """(modules, tensors) per rank of a converted output, from its mocli-layout.json (rank dirs see the top files)."""
    manifest = json.loads((out / "mocli-layout.json").read_text())
    top = safetensors_dir(out)
    if not manifest.get("ranks"):
        return [(manifest["modules"], top)]
    return [(r["modules"], top | safetensors_dir(out / r["dir"])) for r in manifest["ranks"]]
