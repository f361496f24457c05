"""mocli.serve's kernels on converted outputs against the source, module by module, per rank.

The reference is computed here from the *source* checkpoint (read with the safetensors library,
dequantized with its own scales, sliced as SEMANTICS §10 says the rank holds it), with the activation
model of verify's reference semantics (``mocli.verify.quant``: the same input quantization the kernels
must apply, so only the weights' path differs). No vLLM needed; the ``gpu`` copies run the CUDA paths
(torch._scaled_mm, torch._scaled_grouped_mm) and skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fixtures.generate import make_checkpoint
from mocli import serve
from mocli.kinds import ModuleKind
from mocli.loader import open_converted
from mocli.verify.common import THRESHOLDS, rel_error
from mocli.verify.quant import fp8_per_group_dequant, fp8_per_token, fp8_static, nvfp4_quant
from tests.conftest import REAL_LLAMA, REAL_QWEN, run_cli
from tests.reference import dequant_nvfp4, unswizzle_by_offsets

TOKENS = 48
# verify's thresholds (mocli.verify.common.THRESHOLDS): "kept" where the layout holds the source's bits
# (only BF16 output rounding remains: measured 0.0016-0.0017), "unified" where shards' or w1/w3 scales were
# unified (one more rounding of those weights or block scales: measured up to 0.028 FP8, 0.024 NVFP4).
# MoE end to end: the intermediate is re-quantized from GEMM1 outputs that carry that rounding, so some
# of its codes move; measured FP8 0.024-0.052, NVFP4 with rescaled w1/w3 block scales 0.066-0.082.
MOE_UNIFIED = {"fp8_moe": 0.10, "nvfp4_moe": 0.15}
NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}


def dequant(src: dict[str, torch.Tensor], m: str) -> torch.Tensor:
    """float32 [N, K] of a source linear from its own scales (SEMANTICS §1)."""
    w, s = src[m + ".weight"], src[m + ".weight_scale"].float()
    if w.dtype == torch.uint8:
        return dequant_nvfp4(w, src[m + ".weight_scale"], float(src[m + ".weight_scale_2"]))
    q = w.float()
    if s.dim() == 0:
        return q * s
    if s.numel() == q.shape[0]:
        return q * s.reshape(-1, 1)
    return q * s.reshape(q.shape[0] // 128, -1).repeat_interleave(128, 0).repeat_interleave(128, 1)


def activations(kind: str, x: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
    """The GEMM input as the format quantizes it, dequantized (float32)."""
    if kind in ("fp8_linear", "fp8_moe"):
        return fp8_static(x, a).float() * a
    if kind == "fp8_channel_linear":
        q, s = fp8_per_token(x)
        return q.float() * s
    if kind == "fp8_block_linear":
        return fp8_per_group_dequant(x)
    return nvfp4_quant(x, torch.reciprocal(a)) * a


def unified(src, modules: list[str]) -> bool:
    """The converter unified these modules' per-tensor scales (FP8 weight_scale, NVFP4 weight_scale_2)."""
    for role in (".weight_scale_2", ".weight_scale"):
        vals = {float(src[m + role]) for m in modules if m + role in src and src[m + role].dim() == 0}
        if vals:
            return len(vals) > 1
    return False


def input_scale(src, modules: list[str]) -> torch.Tensor | None:
    names = [m + ".input_scale" for m in modules if m + ".input_scale" in src]
    return torch.stack([src[n].float() for n in names]).max() if names else None


def dense_case(src, info, g: torch.Generator):
    """(x for the rank, reference output, threshold) of one dense module; x sized so the format's range
    is used."""
    kind, meta, shards = info["kind"], info["meta"], info["sources"]
    full_k = dequant(src, shards[0]).shape[1]
    slices = meta.get("slices") or [[0, dequant(src, m).shape[0], 0, full_k] for m in shards]
    w = torch.cat([dequant(src, m)[r0:r1, c0:c1] for m, (r0, r1, c0, c1) in zip(shards, slices, strict=True)])
    a = input_scale(src, shards)
    scale = {"fp8_linear": 448 / 4, "nvfp4_linear": 2688 / 4}.get(kind)
    x = torch.randn(TOKENS, full_k, generator=g) * (float(a) * scale if scale else 1.0)
    x = x[:, slices[0][2]:slices[0][3]].bfloat16()  # the kernel sees BF16: quantize the same values
    limits = THRESHOLDS[ModuleKind(kind)]
    return x, activations(kind, x.float(), a) @ w.T, limits.unified if unified(src, shards) else limits.kept


def moe_case(src, info, g: torch.Generator):
    """(x, topk_weights, topk_ids (global), reference, threshold) of one MoE rank: the experts it holds,
    its slice of I."""
    meta, layer = info["meta"], info["sources"][0]
    gate, up, down = NAMES[meta["naming"]]
    total, off, e_local = meta.get("experts_total", meta["experts"]), meta.get("expert_offset", 0), meta["experts"]
    i0, i1 = meta.get("intermediate_slice", [0, meta["intermediate"]])
    every = [f"{layer}.{e}." for e in range(total)]
    a1 = input_scale(src, [p + gate for p in every] + [p + up for p in every])
    a2 = input_scale(src, [p + down for p in every])
    fp8 = info["kind"] == "fp8_moe"
    x = (torch.randn(TOKENS, meta["hidden"], generator=g) * (float(a1) * (448 if fp8 else 2688) / 4)).bfloat16()
    ids = torch.stack([torch.randperm(total, generator=g)[:2] for _ in range(TOKENS)]).to(torch.int32)
    weights = torch.softmax(torch.randn(TOKENS, 2, generator=g), dim=-1)
    xq = activations(info["kind"], x.float(), a1)
    ref = torch.zeros(TOKENS, meta["hidden"])
    for e in range(off, off + e_local):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        p = every[e]
        h = F.silu(xq[tok] @ dequant(src, p + gate)[i0:i1].T) * (xq[tok] @ dequant(src, p + up)[i0:i1].T)
        y = activations(info["kind"], h, a2) @ dequant(src, p + down)[:, i0:i1].T
        ref.index_add_(0, tok, y * weights[tok, slot, None])
    rescaled = fp8 or any(unified(src, [p + gate, p + up]) for p in every)
    return x, weights, ids, ref, MOE_UNIFIED[info["kind"]] if rescaled else THRESHOLDS[ModuleKind(info["kind"])].kept


def check_rank(out, rank, source, device: str, kernels_seen: set[str] | None = None) -> None:
    src = load_file(str(source / "model.safetensors"))
    ck = open_converted(out, rank)
    g = torch.Generator().manual_seed(rank or 0)
    for name, info in ck._module_info.items():
        k = serve.kernel_of(ck, name, device)
        if kernels_seen is not None:
            kernels_seen.add(k.path)
        if isinstance(k, serve.MoeKernel):
            x, w, ids, ref, limit = moe_case(src, info, g)
            got = k(x.to(device), w.to(device), ids.to(device)).float().cpu()
        else:
            x, ref, limit = dense_case(src, info, g)
            got = k(x.to(device)).float().cpu()
        err = rel_error(got, ref)
        assert err <= limit, f"{out.name} rank {rank} {name} ({k.path}): relative error {err:.4f} > {limit}"


SOURCES = {
    "llama-fp8": dict(arch="llama", algo="FP8"),
    "llama-fp8-channel": dict(arch="llama", algo="FP8_PER_CHANNEL_PER_TOKEN"),
    "llama-fp8-block": dict(arch="llama", algo="FP8_PB_WO"),
    "llama-nvfp4": dict(arch="llama", algo="NVFP4"),
    "qwen3moe-fp8": dict(arch="qwen3_moe", algo="FP8"),
    "qwen3moe-nvfp4-rescaled": dict(arch="qwen3_moe", algo="NVFP4", unify_scale_2=False),
    "mixtral-fp8": dict(arch="mixtral", algo="FP8"),
    "mixtral-nvfp4": dict(arch="mixtral", algo="NVFP4"),
}
MOE = {"qwen3moe-fp8", "qwen3moe-nvfp4-rescaled", "mixtral-fp8", "mixtral-nvfp4", "real-qwen"}
# (source, target, tp, ep): every kind on both targets at tp 1, then tensor and expert parallel ranks
CASES = ([(s, t, 1, 1) for s in [*SOURCES, "real-llama", "real-qwen"] for t in ("flashinfer-cutlass", "flashinfer-trtllm")]
         + [(s, "flashinfer-cutlass", 2, 1) for s in ("llama-fp8", "llama-nvfp4", "qwen3moe-fp8", "mixtral-nvfp4")]
         + [(s, t, 2, 2) for s in ("qwen3moe-fp8", "real-qwen") for t in ("flashinfer-cutlass", "flashinfer-trtllm")])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    made: dict = {}

    def get(label: str, target: str, tp: int, ep: int):
        if label not in made:
            made[label] = {"real-llama": REAL_LLAMA, "real-qwen": REAL_QWEN}.get(label) or make_checkpoint(
                root / label, **SOURCES[label])
        out = root / f"{label}-{target}-{tp}-{ep}"
        if not out.exists():
            r = run_cli("convert", made[label], "-o", out, "--target", target, "--tp", tp, "--ep", ep)
            assert r.exit_code == 0, r.stderr
        return made[label], out

    return get


def _ranks(tp: int, ep: int) -> list[int | None]:
    return [None] if max(tp, ep) == 1 else list(range(max(tp, ep)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1].removeprefix('flashinfer-')}-tp{c[2]}-ep{c[3]}")
def test_kernels_match_the_source_cpu(converted, case):
    source, out = converted(*case)
    seen: set[str] = set()
    for rank in _ranks(case[2], case[3]):
        check_rank(out, rank, source, "cpu", seen)
    assert all(p.startswith("emulated") for p in seen), seen  # the CPU has no FP8/NVFP4 kernels


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1].removeprefix('flashinfer-')}-tp{c[2]}-ep{c[3]}")
def test_kernels_match_the_source_cuda(converted, case):
    source, out = converted(*case)
    seen: set[str] = set()
    for rank in _ranks(case[2], case[3]):
        check_rank(out, rank, source, "cuda", seen)
    if torch.cuda.get_device_capability() >= (9, 0) and case[0] in ("llama-fp8", "real-llama", "qwen3moe-fp8"):
        assert "torch._scaled_mm" in seen and ("qwen" not in case[0] or "torch._scaled_grouped_mm" in seen), seen


@pytest.mark.gpu
@pytest.mark.parametrize("label,module", [("llama-fp8", "model.layers.0.self_attn.qkv_proj"),
                                          ("llama-fp8-channel", "model.layers.0.mlp.gate_up_proj"),
                                          ("qwen3moe-fp8", "model.layers.0.mlp.experts")])
@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
def test_fp8_cuda_paths_replay_in_a_cuda_graph(converted, label, module, target):
    """The FP8 tensor-core paths synchronise nothing with the host, so an engine can capture them in a
    CUDA graph: replaying on new inputs gives what a plain call gives."""
    _, out = converted(label, target, 1, 1)
    ck = open_converted(out)
    k = serve.kernel_of(ck, module, "cuda")
    assert not k.emulated, k.path
    g = torch.Generator().manual_seed(0)
    moe = isinstance(k, serve.MoeKernel)
    width = k.hidden if moe else k.k

    def inputs():
        x = torch.randn(32, width, generator=g).bfloat16().cuda()
        if not moe:
            return (x,)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(32)]).int().cuda()
        return x, torch.rand(32, 2, generator=g).cuda(), ids

    static = inputs()
    k(*static)  # first call: the kernel's constants are made here, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = k(*static)
    for _ in range(2):
        new = inputs()
        for s, n in zip(static, new, strict=True):
            s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, k(*new))


def test_expert_map_selects_the_same_experts_as_the_offset(converted):
    """vLLM hands the kernels its global -> local expert map; the rank's offset must pick the same experts."""
    _, out = converted("qwen3moe-fp8", "flashinfer-cutlass", 2, 2)
    ck = open_converted(out, 1)
    name = next(n for n, i in ck._module_info.items() if i["kind"] == "fp8_moe")
    k = serve.kernel_of(ck, name)
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    x = torch.randn(8, 128).bfloat16()
    ids = torch.tensor([[0, 2], [1, 3], [2, 3], [0, 1]] * 2, dtype=torch.int32)
    w = torch.rand(8, 2)
    assert torch.equal(k(x, w, ids, emap), k(x, w, ids))
    assert torch.equal(k(x, w, ids)[3], torch.zeros(128, dtype=torch.bfloat16))  # experts 0, 1 live on rank 0


# --- planted faults: each must push the module past twice its threshold ---------------------------
# measured: swapped w1/w3 0.32 (silu is nearly linear at these activations, so silu(up) * gate is not far
# from silu(gate) * up), MoE scale 2x 0.52, dense scale 2x 1.0, unswizzled block scales 0.29

def _swap_halves(t):
    half = t.shape[1] // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


def _natural(t):
    return unswizzle_by_offsets(t.view(torch.uint8), *t.shape).view(t.dtype)


@pytest.mark.parametrize("label,module,role,fault", [
    ("qwen3moe-fp8", "model.layers.0.mlp.experts", "w13_weight", _swap_halves),
    ("qwen3moe-fp8", "model.layers.0.mlp.experts", "g2_alphas", lambda t: t * 2),
    ("llama-fp8", "model.layers.0.mlp.down_proj", "weight_scale", lambda t: t * 2),
    ("llama-nvfp4", "model.layers.0.self_attn.qkv_proj", "weight_scale", _natural),
], ids=["swapped-w1-w3", "moe-scale-2x", "dense-scale-2x", "unswizzled-block-scale"])
def test_planted_fault_is_caught(converted, label, module, role, fault):
    source, out = converted(label, "flashinfer-cutlass", 1, 1)
    src = load_file(str(source / "model.safetensors"))
    ck = open_converted(out)
    info = ck.module_info(module)
    tensors = {r: ck.tensor(t).clone() for r, t in info["tensors"].items()}
    tensors[role] = fault(tensors[role])
    k = serve.kernel(info["kind"], tensors, info["meta"], ck.target, module)
    g = torch.Generator().manual_seed(0)
    if isinstance(k, serve.MoeKernel):
        x, w, ids, ref, limit = moe_case(src, info, g)
        err = rel_error(k(x, w, ids).float(), ref)
    else:
        x, ref, limit = dense_case(src, info, g)
        err = rel_error(k(x).float(), ref)
    assert err > 2 * limit, (err, limit)


def test_layout_that_breaks_its_own_sizes_is_refused(converted):
    """Tensors whose shape is not the one the module's sizes give never reach a GEMM."""
    _, out = converted("llama-nvfp4", "flashinfer-cutlass", 1, 1)
    ck = open_converted(out)
    name = "model.layers.0.self_attn.o_proj"
    info = ck.module_info(name)
    tensors = {r: ck.tensor(t) for r, t in info["tensors"].items()}
    tensors["weight_scale"] = tensors["weight_scale"][:64]
    with pytest.raises(serve.ServeError, match=r"o_proj.weight_scale is float8_e4m3fn \[64, 8\]"):
        serve.kernel(info["kind"], tensors, info["meta"], ck.target, name)
