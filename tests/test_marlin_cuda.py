"""The marlin target's bytes through vLLM 0.32.0's real CUDA Marlin GEMM (marker gpu).

tools/marlin_cuda/ builds vLLM's Marlin kernel (FP4 weights x BF16 activations) into a torch-free shared
library whose ``mocli_marlin_gemm`` mirrors the host side of vLLM's ``marlin_gemm`` op. Each linear module of a
``--target marlin`` output (NVFP4 §13.5, MXFP4 §19.5; tp 1 and 2) runs through it on random BF16 activations
and is compared, per output column, with ``x @ W.T`` where W is the *source* checkpoint's weight decoded here by
an independent numpy decode (e2m1 table x block scale x global scale; nothing from mocli). Planted faults in
the output (two scale bytes swapped, one weight word flipped) must show up as a failing column.

Run on the GPU machine, from the repo root, after tools/marlin_cuda/build.sh (or with MOCLI_MARLIN_SO naming
the library):  python -m pytest -m gpu tests/test_marlin_cuda.py -v
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from fixtures.generate import make_checkpoint
from tests.conftest import REAL, ROOT, edit_tensor

SO = Path(os.environ.get("MOCLI_MARLIN_SO", ROOT / "tools" / "marlin_cuda" / "build" / "libmocli_marlin.so"))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not SO.exists(), reason=f"{SO} not built (tools/marlin_cuda/build.sh)")]

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
TOL = 1e-2   # per-column relative error; a bf16 GEMM's output rounding is ~3e-3
FAULT = 5e-2  # a planted fault must push some column past this
SOURCES = {"modelopt-nvfp4": REAL / "llama-w4a16_nvfp4", "ct-nvfp4": REAL / "llama-ct-nvfp4a16",
           "ct-mxfp4": REAL / "llama-ct-mxfp4", "odd-nvfp4": None}
DEVICE = "cuda"
TOKENS = [1, 7, 16, 33, 64, 200]  # m_block_size_8, 1..4 thread_m_blocks, and a split past 4 blocks


@pytest.fixture(scope="module")
def lib():
    so = ctypes.CDLL(str(SO))
    so.mocli_marlin_gemm.restype = ctypes.c_int
    so.mocli_marlin_gemm.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64, ctypes.c_int] + [ctypes.c_int64] * 8
                                     + [ctypes.c_int] * 3 + [ctypes.c_void_p])
    so.mocli_marlin_last_error.restype = ctypes.c_char_p
    return so


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """(source dir, output dir) per (source key, tp)."""
    from tests.conftest import run_cli

    base = tmp_path_factory.mktemp("marlin-cuda")
    made = {}
    for key, src in SOURCES.items():
        if src is None:  # hidden 192: padded N and K, and a q/k/v bias
            src = make_checkpoint(base / "odd-src", arch="qwen3_moe", algo="NVFP4", hidden=192, heads=4,
                                  kv_heads=2, head_dim=48, moe_intermediate=96, qkv_bias=True)
        for tp in (1, 2):
            out = base / f"{key}-tp{tp}"
            r = run_cli("-q", "convert", src, "-o", out, "--target", "marlin", "--tp", tp)
            assert r.exit_code == 0, r.stderr
            made[key, tp] = (Path(src), out)
    return made


def _source_tensors(src: Path) -> dict[str, np.ndarray]:
    """Every source tensor as numpy: 1-byte types as their bytes, 16-bit floats widened to float32."""
    t = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, v in load_file(str(f)).items():
            if v.element_size() == 1:
                v = v.view(torch.uint8)
            elif v.dtype in (torch.bfloat16, torch.float16):
                v = v.float()
            t[name] = v.numpy()
    return t


def _e2m1(packed: np.ndarray) -> np.ndarray:
    """[N, K/2] bytes -> [N, K] values; the low nibble is the even element."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return E2M1[codes]


def _e4m3(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    e, m, s = (c >> 3) & 0xF, c & 7, np.where(c & 0x80, -1.0, 1.0)
    return s * np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))


def _dequant(t: dict[str, np.ndarray], mod: str) -> np.ndarray:
    """The source's weight [N, K] in float64, decoded without mocli."""
    if f"{mod}.weight_packed" in t:  # compressed-tensors
        vals, scale = _e2m1(t[f"{mod}.weight_packed"]), t[f"{mod}.weight_scale"]
        if f"{mod}.weight_global_scale" in t:  # NVFP4: w = e2m1 * scale / global
            s = _e4m3(scale.view(np.uint8)) / float(t[f"{mod}.weight_global_scale"].reshape(-1)[0])
        else:  # MXFP4: e8m0 per 32
            s = 2.0 ** (scale.view(np.uint8).astype(np.float64) - 127)
    else:  # ModelOpt NVFP4: w = e2m1 * scale * weight_scale_2
        vals = _e2m1(t[f"{mod}.weight"])
        s = _e4m3(t[f"{mod}.weight_scale"].view(np.uint8)) * float(t[f"{mod}.weight_scale_2"].reshape(-1)[0])
    g = vals.shape[1] // s.shape[1]
    return vals * np.repeat(s, g, axis=1)


def _reference(t, entry, rank: int, tp: int) -> tuple[np.ndarray, np.ndarray | None]:
    """This rank's slice of the fused source weights [n, k] (and bias [n] when the sources have one)."""
    meta, ws, bs = entry.meta, [], []
    for src, rows in zip(entry.sources, meta["shard_rows"], strict=True):
        w, b = _dequant(t, src), t.get(f"{src}.bias")
        if w.shape[0] != rows:  # column parallel: rank's rows
            assert w.shape[0] == tp * rows, (src, w.shape, rows)
            w, b = w[rank * rows:(rank + 1) * rows], None if b is None else b[rank * rows:(rank + 1) * rows]
        if w.shape[1] != meta["k"]:  # row parallel: rank's columns
            k = meta["k"]
            assert w.shape[1] == tp * k, (src, w.shape, k)
            w = w[:, rank * k:(rank + 1) * k]
        ws.append(w)
        bs.append(b)
    bias = None if any(b is None for b in bs) else np.concatenate([b.astype(np.float64) for b in bs])
    return np.concatenate(ws), bias


def _marlin(lib, mod, meta, x: torch.Tensor) -> torch.Tensor:
    """What vLLM's apply_fp4_marlin_linear computes: pad x to Kp, marlin_gemm, slice to N."""
    n, k, np_, kp = meta["n"], meta["k"], meta["padded_n"], meta["padded_k"]
    xp = F.pad(x, (0, kp - k)).contiguous() if kp != k else x.contiguous()
    dev = x.device.index or 0
    c = torch.empty(x.shape[0], np_, dtype=torch.bfloat16, device=x.device)
    ws = torch.zeros(lib.mocli_marlin_sms(dev) * 4, dtype=torch.int32, device=x.device)  # MARLIN_MAX_BLOCKS_PER_SM
    w, s = mod.weight.contiguous(), mod.weight_scale.contiguous()
    nvfp4 = getattr(mod, "weight_global_scale", None) is not None
    gs = mod.weight_global_scale.float().contiguous() if nvfp4 else None
    bias = getattr(mod, "bias", None)
    assert w.dtype == torch.int32 and s.element_size() == 1
    assert bias is None or bias.dtype == torch.bfloat16, bias.dtype
    rc = lib.mocli_marlin_gemm(xp.data_ptr(), c.data_ptr(), w.data_ptr(), s.data_ptr(),
                               None if gs is None else gs.data_ptr(), None if bias is None else bias.data_ptr(),
                               ws.data_ptr(), ws.numel(), 0 if nvfp4 else 1, x.shape[0], np_, kp, xp.stride(0),
                               w.shape[0], w.shape[1], s.shape[0], s.shape[1], 0, 1, dev,
                               torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert rc == 0, lib.mocli_marlin_last_error().decode()
    return c[:, :n].float()


def _column_errors(lib, src: Path, out: Path, tp: int, tokens: int) -> dict[tuple[int, str], float]:
    """Worst per-column relative error of every linear module of every rank."""
    from mocli.loader import load_converted

    t, errs = _source_tensors(src), {}
    gen = torch.Generator().manual_seed(tokens)
    for rank in range(tp):
        ck = load_converted(out, device=DEVICE, rank=None if tp == 1 else rank)
        linear = {n: m for n, m in ck.modules.items() if hasattr(m, "padded_n") and hasattr(m, "weight")}
        assert linear, f"{out}: no Marlin linear modules"
        for name, mod in linear.items():
            entry = ck.module_entry(name)
            w_ref, b_ref = _reference(t, entry, rank, tp)
            x = torch.randn(tokens, entry.meta["k"], generator=gen).to(torch.bfloat16)
            gemm = x.double().numpy() @ w_ref.T
            bias = np.zeros(gemm.shape[1]) if b_ref is None or mod.bias is None else np.asarray(b_ref, np.float64)
            want = gemm + bias
            got = _marlin(lib, mod, entry.meta, x.to(DEVICE)).cpu().double().numpy()
            assert got.shape == want.shape, (name, got.shape, want.shape)
            # relative to the column's product and bias, each at its own size: the kernel rounds their sum to
            # BF16, so where the bias cancels the product (one token: measured on the H200, 16 of 384 columns)
            # the output's own norm is no measure of the rounding (the bias was right: 0.0064 this way)
            num = np.sqrt(((got - want) ** 2).sum(0))
            den = np.sqrt((gemm ** 2).sum(0)) + np.sqrt(tokens) * np.abs(bias) + 1e-30
            errs[rank, name] = float((num / den)[den > 1e-20].max())
        ck.close()
    return errs


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("key", list(SOURCES))
def test_real_marlin_kernel_matches_source_weights(lib, outputs, key, tp, tokens):
    src, out = outputs[key, tp]
    errs = _column_errors(lib, src, out, tp, tokens)
    bad = {k: e for k, e in errs.items() if not e < TOL}
    assert not bad, bad


def _swap_scales(s: torch.Tensor) -> torch.Tensor:
    """Swap the smallest and the largest nonzero scale byte of row 0 (e4m3 and e8m0 both order as bytes)."""
    row = s.view(torch.uint8)[0]
    nz = torch.nonzero(row).reshape(-1)
    i, j = int(nz[row[nz].argmin()]), int(nz[row[nz].argmax()])
    assert row[i] != row[j]
    row[i], row[j] = row[j].clone(), row[i].clone()
    return s


def _flip_word(w: torch.Tensor) -> torch.Tensor:
    w.view(-1)[0] ^= 0x77777777
    return w


@pytest.mark.parametrize("fault", ["scales", "weight"])
@pytest.mark.parametrize("key", ["modelopt-nvfp4", "ct-mxfp4"])
def test_planted_fault_fails_against_real_kernel(lib, outputs, tmp_path, key, fault):
    src, out = outputs[key, 1]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    name = "model.layers.0.mlp.down_proj"
    edit_tensor(bad, f"{name}.weight_scale" if fault == "scales" else f"{name}.weight",
                _swap_scales if fault == "scales" else _flip_word)
    errs = _column_errors(lib, src, bad, 1, 16)
    assert errs[0, name] > FAULT, errs[0, name]
    assert all(e < TOL for (_, n), e in errs.items() if n != name), errs


def test_kernel_reports_bad_arguments(lib):
    """A mismatched size comes back as an error message, not a crash (the mirrored STD_TORCH_CHECKs)."""
    assert lib.mocli_marlin_gemm(None, None, None, None, None, None, None, 0, 1, 16, 256, 256, 256, 3, 512,
                                 8, 256, 0, 1, 0, None) == 1
    assert b"mocli_marlin.cu" in lib.mocli_marlin_last_error()  # where the check failed (its text is cut: not kept)
