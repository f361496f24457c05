"""``mocli verify``: kernel GEMMs on converted tensors against a float32 reference from the source.

Per module: random activations (fixed seed), a reference computed from the *source* checkpoint
(dequantized per shard / per expert, activations quantized as the kernel does, float32 GEMM; for
MoE the whole expert computation), and the kernel output computed from the *converted* tensors via
the public loader. Compare ``‖out - ref‖ / ‖ref‖`` with a per-scheme threshold.
"""

from __future__ import annotations

import hashlib
import math
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mocli.census import Census, build_census
from mocli.checkpoint import Checkpoint, open_checkpoint
from mocli.errors import InputError
from mocli.loader import (
    ConvertedCheckpoint,
    Fp8BlockLinear,
    Fp8ChannelLinear,
    Fp8Linear,
    Fp8MoE,
    Nvfp4Linear,
    Nvfp4MoE,
    load_converted,
    read_manifest,
)
from mocli.tables import INPUT_SCALE, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from mocli.verify import flashinfer_args
from mocli.verify.decode import LayoutError, row_order, unpad, unpermute, unswizzle
from mocli.verify.quant import (
    FP8,
    dequant_fp8,
    dequant_nvfp4,
    fp8_per_group_dequant,
    fp8_per_token,
    fp8_static,
    nvfp4_quant,
    unpack_e2m1,
)

# Relative-error thresholds per module kind. Each is a few times the error the formats themselves
# allow and far below the smallest planted fault (a 2x scale error is a relative error of 0.5-1.0):
# - fp8_linear: requantizing non-max shards to the shared scale rounds each of their weights once
#   more: half an e4m3 step, i.e. 2^-4..2^-3 relative, rms 1.8%..3.6% on those rows (measured on the
#   real Llama export: 1.4-2.0%); BF16 output rounding adds 2^-9.
# - fp8_channel/block_linear, nvfp4_linear: weights are bit-identical to the source; only BF16
#   output rounding and summation order differ (rescaled NVFP4 shards: one fp8 rounding, 2^-4).
# - MoE: both GEMM1 halves carry the requantization error above and silu(gate) * up multiplies them
#   (~sqrt(2) x 3.6%); the intermediate activation is then re-quantized (FP8 e4m3 / NVFP4 e2m1) from
#   slightly different values, so some flip to a neighbouring code (e2m1 codes are up to 33% apart).
#   Measured on the H100 with 256 tokens: FP8 MoE 0.032-0.048, NVFP4 MoE 0.027.
THRESHOLDS: dict[str, float] = {
    "fp8_linear": 0.05,
    "fp8_channel_linear": 0.01,
    "fp8_block_linear": 0.01,
    "nvfp4_linear": 0.03,
    "fp8_moe": 0.10,
    "nvfp4_moe": 0.10,
}


@dataclass
class ModuleResult:
    module: str
    kind: str
    scheme: str
    kernel: str
    emulated: bool
    shape: dict[str, int]
    error: float
    threshold: float
    passed: bool
    seconds: float
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["error"] = None if math.isnan(self.error) else self.error  # JSON has no NaN
        return d


@dataclass
class VerifyOptions:
    source: str | None = None
    device: str = "auto"
    kernels: str = "auto"
    layers: str | None = None
    tokens: int = 64
    seed: int = 0
    check_source_hash: bool = True


@dataclass
class Runtime:
    device: torch.device
    kernels: str
    target: str
    cc: tuple[int, int] | None = None
    fi: Any = None  # the flashinfer module when usable

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Progress:
    start: Callable[[int], None] = lambda total: None
    advance: Callable[[], None] = lambda: None
    results: list[ModuleResult] = field(default_factory=list)


def _runtime(opts: VerifyOptions, target: str) -> Runtime:
    if opts.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif opts.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available", hint="use --device cpu")
    else:
        dev = torch.device(opts.device)
    rt = Runtime(dev, opts.kernels, target)
    if rt.cuda:
        rt.cc = torch.cuda.get_device_capability(dev)
    if opts.kernels != "torch" and rt.cuda:  # FlashInfer kernels are CUDA-only: skip the (slow) import
        try:
            import flashinfer  # noqa: F401
            rt.fi = flashinfer
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            rt.fi = None
    if opts.kernels == "flashinfer" and (rt.fi is None or not rt.cuda):
        raise InputError("--kernels flashinfer needs flashinfer-python and a CUDA device",
                         hint="pip install 'mocli[flashinfer]' on a GPU machine, or use --kernels torch")
    return rt


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _open_source(out: Path, manifest: dict, opts: VerifyOptions) -> Checkpoint:
    prov = manifest.get("provenance") or {}
    recorded = prov.get("source") or {}
    spec = opts.source or recorded.get("path") or (
        f"{recorded['repo_id']}@{recorded['revision']}" if recorded.get("repo_id") else None)
    if spec is None:
        raise InputError(f"{out}: provenance records no source", hint="pass --source MODEL")
    src = open_checkpoint(spec)
    if opts.check_source_hash:
        want = prov.get("source_shards") or {}
        have = {h.path.name: h for h in src.files}
        if set(want) != set(have):
            raise InputError(f"{spec}: source shards {sorted(have)} differ from those recorded at conversion "
                             f"{sorted(want)}", hint="verify against the checkpoint that was converted")
        for name, digest in want.items():
            if _sha256(have[name].path) != digest:
                raise InputError(f"{spec}: {name} no longer matches the SHA-256 recorded at conversion",
                                 hint="the source changed since conversion; convert again or pass the original --source")
    return src


def verify(out: str | Path, opts: VerifyOptions, progress: Progress | None = None) -> dict[str, Any]:
    out = Path(out)
    progress = progress or Progress()
    manifest = read_manifest(out)
    src = _open_source(out, manifest, opts)
    census = build_census(src.tensors)
    rt = _runtime(opts, manifest["target"])
    modules = [m for m in manifest["modules"] if opts.layers is None or fnmatchcase(m["name"], opts.layers)]
    if not modules:
        raise InputError(f"--layers {opts.layers!r} matches no converted module",
                         hint="names look like model.layers.0.self_attn.qkv_proj; use * wildcards")
    ck = load_converted(out, modules=[])
    results: list[ModuleResult] = []
    t_all = time.perf_counter()
    progress.start(len(modules))
    try:
        with src.reader() as reader:
            source = _Source(src, census, reader, rt.device)
            for info in modules:
                results.append(_verify_module(ck, info, source, rt, opts))
                progress.advance()
    finally:
        ck.close()
    failed = [r for r in results if not r.passed]
    return {
        "output": str(out), "source": src.source.describe(), "target": manifest["target"],
        "device": str(rt.device), "tokens": opts.tokens, "seed": opts.seed,
        "modules": [r.to_dict() for r in results], "passed": len(results) - len(failed), "failed": len(failed),
        "ok": not failed, "seconds": round(time.perf_counter() - t_all, 3),
    }


class _Source:
    """Source tensors on demand, on the verify device."""

    def __init__(self, ckpt: Checkpoint, census: Census, reader, device: torch.device) -> None:
        self.ckpt, self.census, self.reader, self.device = ckpt, census, reader, device

    def t(self, name: str) -> torch.Tensor:
        return self.reader.read(self.ckpt.tensors[name]).to(self.device)

    def module(self, name: str):
        return self.census.modules[name]

    def scalar(self, module, suffix: str) -> torch.Tensor:
        return self.t(module.tensors[suffix].name).float().reshape(())

    def dequant(self, module) -> torch.Tensor:
        """float32 [N, K] of one source linear, from its own scales."""
        w = self.t(module.tensors[WEIGHT].name)
        if module.scheme is not None and module.scheme.value == "NVFP4":
            return dequant_nvfp4(w, self.t(module.tensors[WEIGHT_SCALE].name),
                                 self.scalar(module, WEIGHT_SCALE_2))
        return dequant_fp8(w, self.t(module.tensors[WEIGHT_SCALE].name))


def _fp4_kernels(rt: Runtime) -> bool:
    """FlashInfer NVFP4 kernels: sm_100+ only (SEMANTICS §9), cutlass layout only (trtllm: emulated)."""
    return (rt.fi is not None and rt.cuda and rt.cc is not None and rt.cc[0] >= 10 and rt.kernels != "torch"
            and rt.target == "flashinfer-cutlass")


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return math.nan
    denom = float(ref.norm())
    return float((out - ref).norm()) / denom if denom > 0 else float((out - ref).norm())


def _verify_module(ck: ConvertedCheckpoint, info: dict, src: _Source, rt: Runtime,
                   opts: VerifyOptions) -> ModuleResult:
    t0 = time.perf_counter()
    kind = info["kind"]
    threshold = THRESHOLDS[kind]
    shape = {k: v for k, v in info["meta"].items() if isinstance(v, int)}
    try:
        mod = ck.load_module(info["name"], rt.device)
        fn = {Fp8Linear: _fp8_linear, Fp8ChannelLinear: _fp8_channel, Fp8BlockLinear: _fp8_block,
              Nvfp4Linear: _nvfp4_linear, Fp8MoE: _fp8_moe, Nvfp4MoE: _nvfp4_moe}[type(mod)]
        kernel, emulated, out, ref = fn(mod, info, src, rt, opts)
        err = _rel_error(out, ref)
        passed = not math.isnan(err) and err <= threshold
        message = "" if passed else ("output is not finite" if math.isnan(err) else
                                     f"relative error {err:.3g} > {threshold:g}")
    except LayoutError as e:
        kernel, emulated, err, passed, message = "layout check", False, math.nan, False, str(e)
    return ModuleResult(info["name"], kind, info["scheme"], kernel, emulated, shape,
                        err, threshold, passed, round(time.perf_counter() - t0, 4), message)


# --- dense ---------------------------------------------------------------------------------------

def _dense_sources(info: dict, src: _Source) -> list:
    return [src.module(n) for n in info["sources"]]


def _ref_weight(info: dict, src: _Source) -> torch.Tensor:
    return torch.cat([src.dequant(m) for m in _dense_sources(info, src)])


def _ref_bias(info: dict, src: _Source) -> torch.Tensor | None:
    mods = _dense_sources(info, src)
    if all("bias" in m.tensors for m in mods):
        return torch.cat([src.t(m.tensors["bias"].name).float() for m in mods])
    return None


def _with_bias(y: torch.Tensor, ck_bias: torch.Tensor | None) -> torch.Tensor:
    return y if ck_bias is None else y + ck_bias.float()


def _max_input_scale(info: dict, src: _Source) -> torch.Tensor:
    return torch.stack([src.scalar(m, INPUT_SCALE) for m in _dense_sources(info, src)]).max()


def _fp8_linear(mod: Fp8Linear, info, src, rt, opts):
    a_ref = _max_input_scale(info, src)
    x = (torch.randn(opts.tokens, mod.k, generator=_gen(opts.seed, mod.name)) * (float(a_ref) * 448 / 4)).to(rt.device)
    ref = (fp8_static(x, a_ref).float() * a_ref) @ _ref_weight(info, src).T
    xq = fp8_static(x, mod.input_scale)
    out = torch._scaled_mm(xq, mod.weight.t(), scale_a=mod.input_scale.float(), scale_b=mod.weight_scale.float(),
                           out_dtype=torch.bfloat16).float()
    return "torch._scaled_mm", False, out, ref


def _fp8_channel(mod: Fp8ChannelLinear, info, src, rt, opts):
    x = torch.randn(opts.tokens, mod.k, generator=_gen(opts.seed, mod.name)).to(rt.device)
    xq, xs = fp8_per_token(x)
    ref = (xq.float() * xs) @ _ref_weight(info, src).T
    try:
        out = torch._scaled_mm(xq, mod.weight.t(), scale_a=xs, scale_b=mod.weight_scale.float().reshape(1, -1),
                               out_dtype=torch.bfloat16).float()
        return "torch._scaled_mm (rowwise)", False, out, ref
    except (RuntimeError, NotImplementedError):
        w = mod.weight.float() * mod.weight_scale.float().reshape(-1, 1)
        out = ((xq.float() * xs).bfloat16() @ w.bfloat16().T).float()
        return "emulated (dequantized FP8, BF16 GEMM)", True, out, ref


def _fp8_block(mod: Fp8BlockLinear, info, src, rt, opts):
    x = torch.randn(opts.tokens, mod.k, generator=_gen(opts.seed, mod.name)).to(rt.device)
    xd = fp8_per_group_dequant(x)
    ref = xd @ _ref_weight(info, src).T
    s = mod.weight_scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    w = mod.weight.float() * s
    out = xd @ w.T
    return "emulated (dequantized FP8 128x128 blocks, float32 GEMM)", True, out, ref


def _nvfp4_weight_from_layout(mod: Nvfp4Linear, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the converted weight to logical e2m1 codes [N, K/2] and block scales uint8 [N, K/16]."""
    n, k = mod.n, mod.k
    w = unpad(mod.weight, n, k // 2, f"{mod.name}.weight") if target == "flashinfer-cutlass" else mod.weight
    bs = unswizzle(mod.weight_scale, n, k // 16, f"{mod.name}.weight_scale")
    order = row_order(n, target, gated=False)
    return unpermute(w, order), unpermute(bs, order)


def _nvfp4_linear(mod: Nvfp4Linear, info, src, rt, opts):
    a_ref = _max_input_scale(info, src)
    x = (torch.randn(opts.tokens, mod.k, generator=_gen(opts.seed, mod.name)) * (float(a_ref) * 2688 / 4)).to(rt.device)
    ref = (nvfp4_quant(x, 1 / a_ref) * a_ref) @ _ref_weight(info, src).T
    w, bs = _nvfp4_weight_from_layout(mod, rt.target)
    if _fp4_kernels(rt):
        out = flashinfer_args.run_mm_fp4(rt.fi, mod, x)
        return "flashinfer.mm_fp4", False, out, ref
    xa = nvfp4_quant(x, mod.input_scale_inv)  # e2m1 * sf: exact in bf16
    wb = unpack_e2m1(w) * bs.view(FP8).float().repeat_interleave(16, dim=1)  # e2m1 * block scale: exact in bf16
    out = (xa.bfloat16() @ wb.bfloat16().T).float() * mod.alpha.float()
    return "emulated NVFP4 (decoded layout, BF16 GEMM)", True, out, ref


# --- MoE -----------------------------------------------------------------------------------------

@dataclass
class _Routing:
    token: torch.Tensor  # [P] token index per (token, expert) pair, sorted by expert
    expert: torch.Tensor  # [P]
    weight: torch.Tensor  # [P]
    counts: torch.Tensor  # [E]
    topk_ids: torch.Tensor  # [T, k]
    topk_weights: torch.Tensor  # [T, k]

    def groups(self) -> Iterator[tuple[int, slice]]:
        """(expert, its slice of the expert-sorted pairs) for every expert that received tokens."""
        start = 0
        for e, n in enumerate(self.counts.tolist()):
            if n:
                yield e, slice(start, start + n)
            start += n


def _route(tokens: int, experts: int, top_k: int, gen: torch.Generator, device: torch.device) -> _Routing:
    logits = torch.randn(tokens, experts, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    flat_e = ids.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    tok = torch.arange(tokens).repeat_interleave(top_k)[order]
    return _Routing(tok.to(device), flat_e[order].to(device), w.reshape(-1)[order].to(device),
                    torch.bincount(flat_e, minlength=experts).to(device), ids.to(device), w.to(device))


def _top_k(src: _Source, experts: int) -> int:
    k = src.ckpt.config.get("num_experts_per_tok")
    return max(1, min(int(k), experts)) if isinstance(k, int) else min(2, experts)


def _moe_reference(info, src: _Source, x: torch.Tensor, r: _Routing, quant_in, quant_mid) -> torch.Tensor:
    """float32 expert computation from the source: silu(x W1^T) * (x W3^T) -> quant -> W2, weighted sum."""
    layer = next(m for m in src.census.moe if m.name == info["name"])
    out = torch.zeros(x.shape[0], layer.hidden, device=x.device)
    xq = quant_in(x)
    for e, sel in r.groups():
        ex = layer.experts[e]
        xt = xq[r.token[sel]]
        h = F.silu(xt @ src.dequant(ex.gate).T) * (xt @ src.dequant(ex.up).T)
        y = quant_mid(h) @ src.dequant(ex.down).T
        out.index_add_(0, r.token[sel], y * r.weight[sel, None])
    return out


def _layer_scales(info, src: _Source, suffix_proj: list[str]) -> torch.Tensor:
    layer = next(m for m in src.census.moe if m.name == info["name"])
    return torch.stack([src.scalar(getattr(layer.experts[e], p), INPUT_SCALE)
                        for e in sorted(layer.experts) for p in suffix_proj]).max()


def _moe_case(mod: Fp8MoE | Nvfp4MoE, info, src: _Source, rt: Runtime, opts: VerifyOptions, fp4: bool):
    """Activations, routing and the source reference for one MoE layer."""
    a13, a2 = _layer_scales(info, src, ["gate", "up"]), _layer_scales(info, src, ["down"])
    if fp4:
        def qin(t): return nvfp4_quant(t, 1 / a13) * a13
        def qmid(t): return nvfp4_quant(t, 1 / a2) * a2
    else:
        def qin(t): return fp8_static(t, a13).float() * a13
        def qmid(t): return fp8_static(t, a2).float() * a2
    gen = _gen(opts.seed, mod.name)
    # Scaled so the calibrated range (input_scale x format max) covers about 4 standard deviations.
    amax = float(a13) * (448 * 6 if fp4 else 448)
    x = (torch.randn(opts.tokens, mod.hidden, generator=gen) * (amax / 4)).to(rt.device)
    r = _route(opts.tokens, mod.experts, _top_k(src, mod.experts), gen, rt.device)
    return x, r, _moe_reference(info, src, x, r, qin, qmid)


def _fp8_moe(mod: Fp8MoE, info, src, rt, opts):
    e_count, i, h = mod.experts, mod.intermediate, mod.hidden
    x, r, ref = _moe_case(mod, info, src, rt, opts, fp4=False)
    if rt.fi is not None and rt.kernels == "flashinfer":
        out = flashinfer_args.run_cutlass_fused_moe_fp8(rt.fi, mod, x, r.topk_ids, r.topk_weights)
        return "flashinfer.cutlass_fused_moe", False, out, ref
    # Kernel-ready layout: per expert rows [w3; w1] (trtllm: then gated-act reorder + 32-row shuffle).
    w13 = torch.stack([unpermute(mod.w13_weight[e], row_order(2 * i, rt.target, gated=True)) for e in range(e_count)])
    w2 = torch.stack([unpermute(mod.w2_weight[e], row_order(h, rt.target, gated=False)) for e in range(e_count)])
    xq = (x.float() * mod.w13_input_scale_inv.float()).clamp(-448, 448).to(FP8)[r.token]
    g1, g2 = mod.g1_alphas.float(), mod.g2_alphas.float()
    if rt.cuda:
        offs = torch.cumsum(r.counts, 0).to(torch.int32)
        ones = torch.ones(xq.shape[0], device=rt.device)
        o1 = torch._scaled_grouped_mm(xq, w13.transpose(-2, -1), ones, g1[:, None].expand(e_count, 2 * i).contiguous(),
                                      offs=offs, out_dtype=torch.bfloat16).float()
        act = F.silu(o1[:, i:]) * o1[:, :i]  # FlashInfer: act(second half) * first half
        hq = (act * mod.w2_input_scale_inv.float()).clamp(-448, 448).to(FP8)
        o2 = torch._scaled_grouped_mm(hq, w2.transpose(-2, -1), ones, g2[:, None].expand(e_count, h).contiguous(),
                                      offs=offs, out_dtype=torch.bfloat16).float()
        kernel = "torch._scaled_grouped_mm"
    else:
        o2 = torch.empty(xq.shape[0], h)
        one = torch.tensor(1.0)
        for e, sel in r.groups():
            o1 = torch._scaled_mm(xq[sel], w13[e].t(), scale_a=one, scale_b=g1[e], out_dtype=torch.bfloat16).float()
            act = F.silu(o1[:, i:]) * o1[:, :i]
            hq = (act * mod.w2_input_scale_inv.float()).clamp(-448, 448).to(FP8)
            o2[sel] = torch._scaled_mm(hq, w2[e].t(), scale_a=one, scale_b=g2[e], out_dtype=torch.bfloat16).float()
        kernel = "torch._scaled_mm per expert (CPU)"
    out = torch.zeros(opts.tokens, h, device=rt.device).index_add_(0, r.token, o2 * r.weight[:, None])
    return kernel, False, out, ref


def _nvfp4_moe(mod: Nvfp4MoE, info, src, rt, opts):
    i, h = mod.intermediate, mod.hidden
    x, r, ref = _moe_case(mod, info, src, rt, opts, fp4=True)
    if _fp4_kernels(rt):
        out = flashinfer_args.run_cutlass_fused_moe_nvfp4(rt.fi, mod, x, r.topk_ids, r.topk_weights)
        return "flashinfer.cutlass_fused_moe", False, out, ref
    o13, o2_order = row_order(2 * i, rt.target, gated=True), row_order(h, rt.target, gated=False)
    out = torch.zeros(opts.tokens, h, device=rt.device)
    for e, sel in r.groups():
        w13 = unpermute(mod.w13_weight[e], o13)
        bs13 = unpermute(unswizzle(mod.w13_weight_scale[e], 2 * i, h // 16, f"{mod.name}.w13_weight_scale[{e}]"), o13)
        w2 = unpermute(mod.w2_weight[e], o2_order)
        bs2 = unpermute(unswizzle(mod.w2_weight_scale[e], h, i // 16, f"{mod.name}.w2_weight_scale[{e}]"), o2_order)
        b13 = unpack_e2m1(w13) * bs13.view(FP8).float().repeat_interleave(16, 1)
        b2 = unpack_e2m1(w2) * bs2.view(FP8).float().repeat_interleave(16, 1)
        xa = nvfp4_quant(x[r.token[sel]], mod.a1_gscale[e])
        o1 = (xa.bfloat16() @ b13.bfloat16().T).float() * mod.g1_alphas[e].float()
        act = F.silu(o1[:, i:]) * o1[:, :i]
        ha = nvfp4_quant(act, mod.a2_gscale[e])
        o2 = (ha.bfloat16() @ b2.bfloat16().T).float() * mod.g2_alphas[e].float()
        out.index_add_(0, r.token[sel], o2 * r.weight[sel, None])
    return "emulated NVFP4 MoE (decoded layout, BF16 GEMM)", True, out, ref
