"""The converter-pair test (issue 38, SEMANTICS §17.6): compressed-tensors 0.20's own ModelOpt -> compressed-tensors
converter run on real ModelOpt NVFP4 exports (fixtures/real/*-ct, made by make_ct_converted.py), then converted
by mocli, against mocli's conversion of the ModelOpt original, tensor by tensor.

§17.6's statement: weights and block scales (every swizzle, shuffle, padding and [w3; w1] reorder) are the same
bytes; the linear ``input_scale_inv`` is the same value (the stored divisor is fl(1/s) either way); every other
tensor derived from a global scale differs exactly where the float32 double reciprocal fl(1/fl(1/s)) of the
source's global scales changes it, and KV-cache scales are the converter's BF16 cast. "Exactly where" is checked
against a third conversion: the ModelOpt original with its global scales replaced by their double reciprocal,
computed here in numpy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import REAL

PAIRS = ["llama-nvfp4_four_over_six", "qwen3_moe-nvfp4_kv"]
LAYOUTS = {"llama-nvfp4_four_over_six": [("1", "1"), ("2", "1")], "qwen3_moe-nvfp4_kv": [("1", "1"), ("2", "2")]}
GLOBALS = ("weight_scale_2", "input_scale")  # ModelOpt's names of the global scales the converter inverts
SAME_VALUE = ("input_scale_inv",)  # 1 / input_scale: the divisor the converter stores is that value itself
KV = (".k_scale", ".v_scale")


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        out |= {f"{f.parent.relative_to(d)}/{k}": v for k, v in load_file(str(f)).items()}
    return out


def _double_reciprocal(src: Path, dst: Path) -> int:
    """``src`` copied to ``dst`` with every NVFP4 global scale s replaced by fl32(1 / fl32(1 / s)); how many
    values that changed."""
    shutil.copytree(src, dst)
    changed = 0
    for f in dst.glob("*.safetensors"):
        ts = load_file(str(f))
        for name in list(ts):
            module, _, suffix = name.rpartition(".")
            if suffix in GLOBALS and ts.get(f"{module}.weight", torch.empty(0)).dtype == torch.uint8:
                v = ts[name].numpy().astype(np.float32)
                dr = np.reciprocal(np.reciprocal(v))
                changed += int((dr != v).sum())
                ts[name] = torch.from_numpy(np.array(dr, dtype=np.float32).reshape(v.shape))
        save_file(ts, str(f), metadata={"format": "pt"})
    return changed


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm", "marlin"])
@pytest.mark.parametrize("name", PAIRS)
def test_mocli_of_the_converters_output_matches_mocli_of_the_modelopt_original(cli, tmp_path, name, target):
    dr_src = tmp_path / "dr"
    assert _double_reciprocal(REAL / name, dr_src) > 0  # the real scales do hit the ≈14 % that move
    for tp, ep in LAYOUTS[name]:
        outs = {}
        for key, src in (("modelopt", REAL / name), ("ct", REAL / f"{name}-ct"), ("dr", dr_src)):
            out = tmp_path / f"{key}-{tp}-{ep}"
            r = cli("convert", src, "-o", out, "--target", target, "--tp", tp, "--ep", ep)
            assert r.exit_code == 0, r.stderr
            outs[key] = _tensors(out)
        mo, ct, dr = outs["modelopt"], outs["ct"], outs["dr"]
        assert mo.keys() == ct.keys() == dr.keys()
        moved = 0
        for t in mo:
            a, b, c = mo[t], ct[t], dr[t]
            if t.endswith(KV):  # the converter's BF16 cast of the F32 scale
                assert b.dtype == torch.bfloat16 and b.float().reshape(()) == a.to(torch.bfloat16).float().reshape(()), t
                continue
            assert a.shape == b.shape and a.dtype == b.dtype, t
            if t.endswith(SAME_VALUE):
                assert _bytes(b) == _bytes(a), t
                continue
            # everything else is mocli(ModelOpt with double-reciprocal globals): weights and block scales, which
            # that leaves alone, equal to the original's
            assert _bytes(b) == _bytes(c), t
            if _bytes(b) != _bytes(a):
                assert t.rpartition(".")[2] not in ("weight", "weight_scale", "w13_weight", "w2_weight",
                                                    "w13_weight_scale", "w2_weight_scale"), t
                moved += 1
        assert moved > 0, "no global scale moved: the pair does not test the double reciprocal"
