"""convert / validate / verify --mxfp4-experts fp8-block (issue 46 item 7, SEMANTICS §19.7): the real compressed-
tensors and Quark Qwen3-MoE MXFP4 exports (their attention dequantized and excluded, as in test_mxfp4_trtllm)
written as fp8_block_moe per rank, the stored block FP8 dequantized here (torch's float8 cast, not mocli's table)
equal to the source's MXFP4 values decoded here by hand (numpy), bit for bit; TGT001 / TGT002 / TGT004 and the
usage error where the re-encoding does not apply; verify proving the equality and catching planted faults. The real
exports' I = 128 allows tp 1 and ep 2 only (a rank's 2I must be a multiple of 256); tp 2 runs on a copy of the CT one
with its experts widened to I = 256 (random bytes and E8M0 codes, decoded here the same way)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REAL, digest_tree, edit_tensor, load_tensors
from tests.test_mxfp4_trtllm import experts_only

NAMES = ("qwen3_moe-ct-mxfp4", "qwen3_moe-quark-mxfp4")
FP8 = ("--mxfp4-experts", "fp8-block")
CUTLASS = "flashinfer-cutlass"
LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fp8block")
    return {n: experts_only(REAL / n, base / n) for n in NAMES}


def decode_by_hand(packed: torch.Tensor, codes: torch.Tensor) -> np.ndarray:
    """float64 [N, K]: low nibble first, sign bit 8, e2m1 magnitude times 2^(code - 127) per 32 values."""
    p = packed.numpy().astype(np.int64)
    nib = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)
    mag = np.array(E2M1)[nib & 7] * np.where(nib & 8, -1.0, 1.0)
    return mag * 2.0 ** (np.repeat(codes.numpy().astype(np.int64), 32, axis=1) - 127.0)


def fp8_values(w: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    """[M, K] e4m3 times its [M/128, K/128] float32 block scales, float64."""
    full = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (w.view(torch.float8_e4m3fn).double() * full).numpy()


def _expert(src: dict, layer: str, e: int, proj: str) -> np.ndarray:
    p = f"{layer}.{e}.{proj}_proj"
    return decode_by_hand(src.get(f"{p}.weight_packed", src.get(f"{p}.weight")), src[f"{p}.weight_scale"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp,ep", (("1", "1"), ("1", "2")))
def test_cutlass_fp8_block_equals_the_source_by_hand(inputs, cli, tmp_path, name, tp, ep):
    src, out = inputs[name], tmp_path / "out"
    r = cli("validate", src, "--target", CUTLASS, "--tp", tp, "--ep", ep, *FP8)
    assert r.exit_code == 0, r.stdout
    r = cli("convert", src, "-o", out, "--target", CUTLASS, "--tp", tp, "--ep", ep, *FP8)
    assert r.exit_code == 0, r.stdout + r.stderr
    manifest = json.loads((out / "mocli-layout.json").read_text())
    assert manifest["provenance"]["mxfp4_experts"] == "fp8-block"
    mods = manifest["modules"] + [m for r in manifest.get("ranks", []) for m in r["modules"]]
    experts = [m for m in mods if m["name"] in LAYERS]
    assert len(experts) == 2 * int(ep) and all(m["kind"] == "fp8_block_moe" and m["meta"]["reencoded_from"] == "mxfp4" for m in experts)
    source, ranks, e_total = load_tensors(src), int(ep), json.loads((src / "config.json").read_text())["num_local_experts"]
    for rank in range(ranks):
        got = load_tensors(out / f"rank-{rank}" if ranks > 1 else out)
        for layer in LAYERS:
            w13, s13, w2, s2 = (got[f"{layer}.{t}"] for t in ("w13_weight", "w13_weight_scale", "w2_weight",
                                                                "w2_weight_scale"))
            assert w13.dtype == torch.float8_e4m3fn and s13.dtype == torch.float32
            e0 = rank * e_total // ranks
            assert w13.shape[0] == e_total // ranks
            for local in range(w13.shape[0]):
                e = e0 + local
                want13 = np.concatenate([_expert(source, layer, e, "up"), _expert(source, layer, e, "gate")])
                assert np.array_equal(fp8_values(w13[local], s13[local]), want13), (rank, layer, e)
                assert np.array_equal(fp8_values(w2[local], s2[local]), _expert(source, layer, e, "down"))
                # one power of two per block, above the engine's 1e-10 clamp
                assert bool(((torch.frexp(s13[local])[0] == 0.5) & (s13[local] > 1e-10)).all())
    r = cli("verify", out)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "re-encoded from MXFP4" in r.stdout


def test_trtllm_fp8_block_verifies(inputs, cli, tmp_path):
    out = tmp_path / "out"
    r = cli("convert", inputs[NAMES[0]], "-o", out, "--target", "flashinfer-trtllm", *FP8)
    assert r.exit_code == 0, r.stdout + r.stderr
    kinds = {m["kind"] for m in json.loads((out / "mocli-layout.json").read_text())["modules"]}
    assert "fp8_block_moe" in kinds and "mxfp4_moe" not in kinds
    assert cli("verify", out).exit_code == 0


def test_tp2_breaks_the_block_shape_rule(inputs, cli, tmp_path):
    # I = 128: a rank's I = 64 is no whole 128-block (SEMANTICS §18.3)
    r = cli("validate", inputs[NAMES[0]], "--target", CUTLASS, "--tp", "2", *FP8)
    assert r.exit_code == 1 and "TGT001" in r.stdout and "2I = 128" in r.stdout
    r = cli("convert", inputs[NAMES[0]], "-o", tmp_path / "out", "--target", CUTLASS, "--tp", "2", *FP8)
    assert r.exit_code == 1 and not (tmp_path / "out").exists()


def test_native_default_unchanged(inputs, cli, tmp_path):
    src = inputs[NAMES[0]]
    r = cli("validate", src, "--target", CUTLASS)
    assert r.exit_code == 1 and "TGT002" in r.stdout and "--target flashinfer-trtllm" in r.stdout
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli("convert", src, "-o", a, "--target", "flashinfer-trtllm").exit_code == 0
    assert cli("convert", src, "-o", b, "--target", "flashinfer-trtllm", "--mxfp4-experts", "native").exit_code == 0
    assert digest_tree(a) == digest_tree(b)
    manifest = json.loads((a / "mocli-layout.json").read_text())
    assert "mxfp4_experts" not in manifest["provenance"]
    assert {m["kind"] for m in manifest["modules"] if m["name"] in LAYERS} == {"mxfp4_moe"}
    assert all("reencoded_from" not in m["meta"] for m in manifest["modules"])


def test_marlin_with_fp8_block_is_a_usage_error(inputs, cli, tmp_path):
    for cmd in (("validate", inputs[NAMES[0]]), ("convert", inputs[NAMES[0]], "-o", tmp_path / "out")):
        r = cli(*cmd, "--target", "marlin", *FP8)
        assert r.exit_code == 2 and "--mxfp4-experts fp8-block" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", (CUTLASS, "flashinfer-trtllm"))
def test_gpt_oss_refused_naming_who_serves_it(cli, tmp_path, target):
    r = cli("validate", REAL / "gpt_oss-mxfp4", "--target", target, *FP8)
    assert r.exit_code == 1 and "TGT002" in r.stdout
    text = " ".join(r.stdout.split())
    assert "swigluoai" in text and "--target flashinfer-trtllm" in text
    r = cli("convert", REAL / "gpt_oss-mxfp4", "-o", tmp_path / "out", "--target", target, *FP8)
    assert r.exit_code == 1 and not (tmp_path / "out").exists()


def test_block_that_fits_no_scale_refused_naming_it(inputs, cli, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(inputs[NAMES[0]], src)
    name = "model.layers.1.mlp.experts.3.down_proj"

    def plant(codes: torch.Tensor) -> torch.Tensor:  # two E8M0 codes of one block (rows 0 and 1, block col 0) 40 apart
        codes[0, 0], codes[1, 1] = 150, 110
        return codes

    edit_tensor(src, f"{name}.weight_scale", plant)
    r = cli("validate", src, "--target", CUTLASS, *FP8, "--output-format", "concise")
    assert r.exit_code == 1, r.stdout
    line = next(x for x in r.stdout.splitlines() if "TGT004" in x)
    assert f"{name}.weight_packed" in line and "expert 3 down" in line and "block (row 0, col 0)" in line
    assert "exponent spread" in line
    out = tmp_path / "out"
    r = cli("convert", src, "-o", out, "--target", CUTLASS, *FP8)
    assert r.exit_code == 1 and "TGT004" in r.stdout + r.stderr and not out.exists()
    assert cli("validate", src, "--target", "flashinfer-trtllm").exit_code == 0  # native: no such constraint


@pytest.mark.parametrize("name", NAMES)
def test_verify_catches_planted_faults(inputs, cli, tmp_path, name):
    out = tmp_path / "out"
    assert cli("convert", inputs[name], "-o", out, "--target", CUTLASS, *FP8).exit_code == 0
    layer = LAYERS[1]

    def flip(t: torch.Tensor) -> torch.Tensor:
        b = t.view(torch.uint8)
        b[2, 5, 7] ^= 0x01
        return b.view(torch.float8_e4m3fn)

    def halve(t: torch.Tensor) -> torch.Tensor:
        t[1, 1, 0] *= 2
        return t

    for what, tensor, fn in (("w13", "w13_weight", flip), ("w2", "w2_weight_scale", halve)):
        bad = tmp_path / f"bad-{what}"
        import shutil

        shutil.copytree(out, bad)
        edit_tensor(bad, f"{layer}.{tensor}", fn)
        r = cli("verify", bad, "--source", inputs[name])
        text = " ".join((r.stdout + r.stderr).split())
        assert r.exit_code == 1, what
        assert "differs from the MXFP4 source" in text, text[-2000:]


@pytest.mark.parametrize("target", (CUTLASS, "flashinfer-trtllm"))
def test_serving_kernel_matches_an_moe_of_the_source(inputs, cli, tmp_path, target):
    """The fp8_block_moe kernel (FP8 activations per token and group of 128) on the re-encoded experts against a
    SiLU MoE of the source's MXFP4 experts decoded here: FP8-quantized activations cost ~0.04 on this seed (a
    w1/w3 swap or a 2x scale is 0.3 and more)."""
    from mocli.loader import open_converted
    from mocli.serve import kernel_of

    src, out = inputs[NAMES[1]], tmp_path / "out"
    assert cli("convert", src, "-o", out, "--target", target, *FP8).exit_code == 0
    layer, cfg = LAYERS[1], json.loads((src / "config.json").read_text())
    e_total, h, k = cfg["num_local_experts"], cfg["hidden_size"], 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(16)])
    wts = torch.rand(16, k, generator=g)
    got = kernel_of(open_converted(out), layer)(x, wts, ids).float()
    source, want = load_tensors(src), torch.zeros(16, h, dtype=torch.float64)
    for t in range(16):
        for j in range(k):
            e = int(ids[t, j])
            f = {p: torch.from_numpy(_expert(source, layer, e, p)) for p in ("gate", "up", "down")}
            xt = x[t].double()
            want[t] += wts[t, j].double() * ((torch.nn.functional.silu(xt @ f["gate"].T) * (xt @ f["up"].T)) @ f["down"].T)
    err = float((got.double() - want).norm() / want.norm())
    assert err < 0.05, err


@pytest.fixture(scope="module")
def wide(inputs, tmp_path_factory) -> Path:
    """The real CT Qwen3-MoE export (attention dequantized, as above) with every expert widened to I = 256 (H = 256):
    random packed e2m1 bytes and random E8M0 codes in 120..133 (spread 13 <= 14 per 128x128 block), so a tp 2
    rank's 2I = 256 is one whole 128-block pair (§18.3); config's moe_intermediate_size follows."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path_factory.mktemp("wide") / "qwen3_moe-ct-mxfp4-i256"
    shutil.copytree(inputs[NAMES[0]], dst)
    cfg = json.loads((dst / "config.json").read_text())
    h, i = cfg["hidden_size"], 256
    cfg["moe_intermediate_size"] = i
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(46)
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for f in dst.glob("*.safetensors"):
        t = load_file(str(f))
        for name in [n for n in t if ".experts." in n]:
            n, k = shapes[name.rsplit(".", 2)[1]]
            t[name] = (torch.randint(0, 256, (n, k // 2), generator=g) if name.endswith("weight_packed")
                       else torch.randint(120, 134, (n, k // 32), generator=g)).to(torch.uint8)
        save_file(t, str(f), metadata={"format": "pt"})
    return dst


def test_cutlass_tp2_fp8_block_equals_the_source_by_hand(wide, cli, tmp_path):
    """tp 2: each rank holds every expert with its half of I (up/gate rows, down columns), re-encoded losslessly."""
    out, tp = tmp_path / "out", ("--tp", "2")
    r = cli("validate", wide, "--target", CUTLASS, *tp, *FP8)
    assert r.exit_code == 0, r.stdout
    r = cli("convert", wide, "-o", out, "--target", CUTLASS, *tp, *FP8)
    assert r.exit_code == 0, r.stdout + r.stderr
    manifest = json.loads((out / "mocli-layout.json").read_text())
    mods = manifest["modules"] + [m for r in manifest.get("ranks", []) for m in r["modules"]]
    experts = [m for m in mods if m["name"] in LAYERS]
    assert len(experts) == 4 and all(m["kind"] == "fp8_block_moe" and m["meta"]["reencoded_from"] == "mxfp4" for m in experts)
    source, e_total = load_tensors(wide), json.loads((wide / "config.json").read_text())["num_local_experts"]
    half = 128
    for rank in range(2):
        got, rows = load_tensors(out / f"rank-{rank}"), slice(rank * half, (rank + 1) * half)
        for layer in LAYERS:
            w13, s13, w2, s2 = (got[f"{layer}.{t}"] for t in ("w13_weight", "w13_weight_scale", "w2_weight",
                                                                "w2_weight_scale"))
            assert w13.shape == (e_total, 2 * half, 256) and w2.shape == (e_total, 256, half), (w13.shape, w2.shape)
            assert s13.shape == (e_total, 2, 2) and s2.shape == (e_total, 2, 1)
            for e in range(e_total):
                want13 = np.concatenate([_expert(source, layer, e, "up")[rows], _expert(source, layer, e, "gate")[rows]])
                assert np.array_equal(fp8_values(w13[e], s13[e]), want13), (rank, layer, e)
                assert np.array_equal(fp8_values(w2[e], s2[e]), _expert(source, layer, e, "down")[:, rows]), (rank, e)
    r = cli("verify", out)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "re-encoded from MXFP4" in r.stdout


def test_trtllm_tp2_fp8_block_verifies(wide, cli, tmp_path):
    out = tmp_path / "out"
    assert cli("validate", wide, "--target", "flashinfer-trtllm", "--tp", "2", *FP8).exit_code == 0
    r = cli("convert", wide, "-o", out, "--target", "flashinfer-trtllm", "--tp", "2", *FP8)
    assert r.exit_code == 0, r.stdout + r.stderr
    manifest = json.loads((out / "mocli-layout.json").read_text())
    mods = manifest["modules"] + [m for r in manifest.get("ranks", []) for m in r["modules"]]
    assert {m["kind"] for m in mods if m["name"] in LAYERS} == {"fp8_block_moe"}
    r = cli("verify", out, "--source", wide)
    assert r.exit_code == 0, r.stdout + r.stderr
