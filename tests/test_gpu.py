"""GPU paths (marker gpu; skipped without CUDA): torch FP8 kernels on the device, CPU == CUDA bytes.

Run on the lent H100: `make test-gpu`. The CPU-vs-CUDA conversion identity test is in test_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.generate import make_checkpoint
from tests.conftest import REAL_LLAMA, REAL_QWEN

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
