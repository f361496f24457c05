"""GPU paths (marker gpu; skipped without CUDA): torch FP8 kernels on the device, CPU == CUDA bytes.

Run on the lent H100: `make test-gpu`. The CPU-vs-CUDA conversion identity test is in test_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.generate import make_checkpoint
from tests.conftest import REAL_LLAMA, REAL_QWEN, digest_tree

pytestmark = pytest.mark.gpu

CASES = [("real-llama", None, None), ("real-qwen", None, None), ("mixtral", "mixtral", "FP8"),
         ("qwen-fp8", "qwen3_moe", "FP8"), ("llama-channel", "llama", "FP8_PER_CHANNEL_PER_TOKEN"),
         ("llama-block", "llama", "FP8_PB_WO")]


def _source(tmp_path, key, arch, algo):
    if key == "real-llama":
        return REAL_LLAMA
    if key == "real-qwen":
        return REAL_QWEN
    return make_checkpoint(tmp_path / "src", arch=arch, algo=algo)


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("key,arch,algo", CASES)
def test_verify_on_cuda(cli, tmp_path, key, arch, algo, target):
    src = _source(tmp_path, key, arch, algo)
    assert cli("-q", "convert", src, "-o", tmp_path / "o", "--target", target, "--device", "cuda").exit_code == 0
    r = cli("--json", "verify", tmp_path / "o", "--device", "cuda", "--kernels", "torch", "--tokens", "256")
    assert r.exit_code == 0, r.stdout
    for m in r.json["modules"]:
        if m["kind"] == "fp8_moe":
            assert m["kernel"] == "torch._scaled_grouped_mm" and not m["emulated"]
        if m["kind"] == "fp8_linear":
            assert m["kernel"] == "torch._scaled_mm" and not m["emulated"]
        if m["kind"] == "fp8_channel_linear":
            assert m["kernel"].startswith("torch._scaled_mm")
        assert m["passed"] and m["error"] < m["threshold"]


def test_scaled_grouped_mm_detects_swapped_halves_on_cuda(cli, tmp_path):
    from safetensors.torch import load_file, save_file

    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8")
    out = tmp_path / "o"
    assert cli("-q", "convert", src, "-o", out, "--target", "flashinfer-cutlass", "--device", "cuda").exit_code == 0
    f = next(out.glob("model-*.safetensors"))
    t = load_file(str(f))
    name = "model.layers.0.block_sparse_moe.experts.w13_weight"
    w = t[name]
    t[name] = torch.cat([w[:, 128:], w[:, :128]], dim=1).contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    r = cli("--json", "verify", out, "--device", "cuda", "--kernels", "torch")
    assert r.exit_code == 1
    bad = [m for m in r.json["modules"] if not m["passed"]]
    assert [m["module"] for m in bad] == ["model.layers.0.block_sparse_moe.experts"]


# --- per rank (SEMANTICS §10) on the GPU ------------------------------------------------------------------


PER_RANK = [("qwen3_moe", "NVFP4", ["--tp", "2"]), ("qwen3_moe", "NVFP4", ["--tp", "2", "--ep", "2"]),
            ("mixtral", "FP8", ["--tp", "2"]), ("mixtral", "FP8", ["--ep", "2"]), ("llama", "FP8", ["--tp", "2"])]


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("arch,algo,par", PER_RANK, ids=[f"{a}-{b}-{'-'.join(p)}" for a, b, p in PER_RANK])
def test_per_rank_cuda_equals_cpu_and_verifies_with_fp8_kernels(cli, tmp_path, arch, algo, par, target):
    src = make_checkpoint(tmp_path / "src", arch=arch, algo=algo, heads=4, kv_heads=2, head_dim=32,
                          moe_intermediate=256, unify_scale_2=False)
    for dev in ("cpu", "cuda"):
        r = cli("--json", "convert", src, "-o", tmp_path / dev, "--target", target, "--device", dev, *par)
        assert r.exit_code == 0, r.stderr
    assert digest_tree(tmp_path / "cpu") == digest_tree(tmp_path / "cuda")
    r = cli("--json", "verify", tmp_path / "cuda", "--device", "cuda", "--kernels", "torch", "--tokens", "256")
    assert r.exit_code == 0, [m["message"] for m in r.json["modules"] if not m["passed"]]
    for m in r.json["modules"]:
        if m["kind"] == "fp8_moe":
            assert m["kernel"] == "torch._scaled_grouped_mm"
        if m["kind"] == "fp8_linear":
            assert m["kernel"] == "torch._scaled_mm"
    assert all(c["passed"] for c in r.json["cross_rank"])


def test_bulk_cuda_load_equals_cpu(cli, tmp_path):
    from mocli.loader import load_converted

    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4")
    assert cli("-q", "convert", src, "-o", tmp_path / "o", "--target", "flashinfer-cutlass").exit_code == 0
    a, b = load_converted(tmp_path / "o"), load_converted(tmp_path / "o", device="cuda")
    for name, mod in a.modules.items():
        for f, v in vars(mod).items():
            if isinstance(v, torch.Tensor):
                w = getattr(b.modules[name], f)
                assert w.device.type == "cuda" and torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                                                               (w.view(torch.uint8) if w.element_size() == 1 else w).cpu())


def test_torchrun_two_gpus_nccl_matches_one_process(tmp_path):
    import os
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from tests.conftest import PYTHONPATH, run_cli

    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8", experts=8, shards=2)
    assert run_cli("-q", "convert", src, "-o", tmp_path / "one", "--target", "flashinfer-trtllm", "--tp", "2",
                   "--device", "cpu").exit_code == 0
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "NCCL_NVLS_ENABLE": "0"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mocli", "-q",
                        "convert", str(src), "-o", str(tmp_path / "two"), "--target", "flashinfer-trtllm", "--tp", "2",
                        "--device", "cuda"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert digest_tree(tmp_path / "one") == digest_tree(tmp_path / "two")


def test_cuda_warmed_before_torch_is_the_context_torch_uses():
    """mocli.devices.warm_cuda makes the device's primary context while torch imports; torch's runtime must
    then run in that very context (not a second one), and under torchrun on the LOCAL_RANK's device."""
    import os
    import subprocess
    import sys

    code = """
import ctypes, threading
from mocli import devices
devices.warm_cuda("cuda")
for t in threading.enumerate():
    if t.name == "mocli-cuda-warm":
        t.join()
import torch
from mocli.devices import resolve_device
dev = resolve_device("cuda")
torch.ones(1, device=dev).sum().item()
cur = ctypes.c_void_p()
assert ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(cur)) == 0
assert devices._held == {dev.index: cur.value}, (devices._held, dev, cur.value)
print("ok")
"""
    for local_rank in ("0", str(torch.cuda.device_count() - 1)):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "LOCAL_RANK": local_rank})
        assert p.returncode == 0 and p.stdout.strip() == "ok" and not p.stderr, p.stderr


@pytest.mark.parametrize("s,big", [(3.1e-3, 4.7e-3), (2.0e-3, 2.0e-3), (1.7e-6, 2.9e-6), (1.3e-6, 1.3e-6), (211.0, 300.0)])
def test_float16_requantization_matches_what_cuda_computes(s, big):
    """vLLM's ``per_tensor_dequantize`` on the GPU: a float16 weight times a 0-dim float32 CUDA scale (the scale
    rounded to float16 too, SEMANTICS §17.2), then the static FP8 quantization x * (1 / big): mocli's table
    (``requantize_fp8(f16=True)``, what a compressed-tensors per-tensor FP8 conversion writes) agrees on every code."""
    import numpy as np

    from mocli.ops import fp8

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    q = codes.cuda().view(torch.float8_e4m3fn)
    dq = q.to(torch.float16) * torch.tensor(s, dtype=torch.float32, device="cuda")
    inv = 1 / torch.tensor(big, dtype=torch.float32, device="cuda")
    want = (dq.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
    got = fp8.requantize_fp8(codes.numpy(), np.float32(s), np.float32(big), f16=True)
    assert (got == want).all(), np.flatnonzero(got != want)


def test_marlin_repack_on_cuda_is_the_cpu_bytes(cli, tmp_path, monkeypatch):
    """The Marlin repack as torch ops on the GPU (convert --device cuda) gives the numpy path's bytes:
    the ops on CUDA tensors, then whole conversions of an NVFP4 MoE (odd sizes: padding) compared file
    by file."""
    import numpy as np

    from mocli.ops import marlin, marlin_torch

    g = torch.Generator().manual_seed(3)
    for n, k in ((1536, 4096), (4096, 1536), (100, 48), (320, 96)):
        w = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        np_, kp = marlin.padded_nk(n, k)
        assert np.array_equal(marlin_torch.repack(w.cuda(), np_, kp).cpu().numpy(), marlin.repack(w.numpy(), np_, kp))
        codes = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
        table = marlin.scale_table(2.0)
        assert np.array_equal(marlin_torch.permute_scales(codes.cuda(), np_, kp, table).cpu().numpy(),
                              marlin.permute_scales(codes.numpy(), np_, kp, table))
    monkeypatch.setattr("mocli.stream.job.GPU_UNITS", True)  # as on a host of under 8 cores
    sources = [REAL_QWEN, make_checkpoint(tmp_path / "odd", arch="qwen3_moe", algo="NVFP4", hidden=192, heads=4,
                                          kv_heads=2, head_dim=48, moe_intermediate=96)]
    for i, src in enumerate(sources):
        for tp in ("1", "2"):
            outs = {}
            for device in ("cpu", "cuda"):
                outs[device] = tmp_path / f"{i}-{tp}-{device}"
                r = cli("--json", "convert", src, "-o", outs[device], "--target", "marlin", "--tp", tp, "--device", device)
                assert r.exit_code == 0, r.stdout
            assert r.json["device"].startswith("cuda"), r.json  # the weights went through the GPU
            assert digest_tree(outs["cpu"]) == digest_tree(outs["cuda"])


def test_shard_into_cuda_scatters_chunks_across_tensor_boundaries(tmp_path, monkeypatch):
    """Staging chunks of 4 KiB: tensors start and end inside chunks, and one spans several."""
    from safetensors.torch import load_file

    import mocli.loader
    from mocli.io.safetensors_file import read_header

    monkeypatch.setattr(mocli.loader, "STAGE", 4096)
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4")
    files = sorted(src.glob("*.safetensors"))
    want = {n: t for f in files for n, t in load_file(str(f)).items()}
    entries = [e for f in files for e in read_header(f).tensors.values()]
    names = sorted(want)[::2]
    targets = {n: torch.zeros_like(want[n], device="cuda") for n in names}
    rest = {n: t for r in mocli.loader.shard_into(entries, targets, "cuda") for n, t in r.items()}
    assert sorted(rest) == sorted(set(want) - set(names))
    for n, t in [*targets.items(), *rest.items()]:
        assert t.device.type == "cuda" and torch.equal(t.cpu().reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)), n
