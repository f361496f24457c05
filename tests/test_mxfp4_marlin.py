"""convert --target marlin on MXFP4 linears (SEMANTICS §19.5): the byte moves against tests/reference.py's
step-by-step restatement of vLLM's prepare_fp4_layer_for_marlin (MXFP4 branch), every real MXFP4 dense export
through validate, convert and verify per rank, and planted faults verify must name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mocli.ops import mxfp4_marlin as mx
from mocli.targets import mxfp4_marlin_decode as lay
from mocli.targets.decode import LayoutError
from tests import reference as ref
from tests.conftest import REAL, edit_tensor

DENSE = ["llama-ct-mxfp4", "llama-ct-mxfp4a16", "llama-quark-mxfp4"]
MOE = ["qwen3_moe-ct-mxfp4", "qwen3_moe-ct-mxfp4a16", "qwen3_moe-quark-mxfp4"]
GPT_OSS = ["gpt_oss-mxfp4", "gpt_oss-quark-mxfp4", "gpt_oss-ct-mxfp4a16"]
Q0 = "model.layers.0.mlp.experts"
QKV, O_PROJ = "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"


# --- the byte moves, against the reference ------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(256, 256), (192, 192), (96, 320), (64, 64), (200, 96)])
def test_scales_weight_and_bias_match_the_reference(n, k, byte_moves):
    """Random codes of every value (0..254), shapes that pad N, K or both: the E8M0 bytes equal the
    reference's (vLLM's torch chain through bf16), the weight equals NVFP4's repack reference, the bias
    its marlin_permute_bias; the decode inverts all three."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    codes = torch.randint(0, 255, (n, k // 32), dtype=torch.uint8, generator=g)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    np_, kp = mx.padded_nk(n, k)
    got = mx.permute_scales(codes.numpy(), np_, kp)
    assert np.array_equal(got, ref.marlin_mxfp4_scales(codes, np_, kp).numpy())
    w = mx.repack(packed.numpy(), np_, kp)
    assert np.array_equal(w.view(np.int32), ref.marlin_repack(packed, np_, kp).numpy())
    b = mx.permute_bias(bias.view(torch.int16).numpy(), np_)
    assert np.array_equal(b, ref.marlin_bias(bias, np_).view(torch.int16).numpy())
    assert np.array_equal(lay.decode_scales(got, n, k // 32, "s"), codes.numpy())
    assert np.array_equal(lay.decode_weight(w, n, k, "w"), packed.numpy())
    assert np.array_equal(lay.decode_bias(b, n, "b"), bias.view(torch.int16).numpy())


def test_every_e8m0_code_survives_the_bf16_chain():
    """SEMANTICS §19.5: for bf16 models vLLM's E8M0 -> bf16 -> E8M0 casts keep all 256 codes (the planner
    only moves bytes), and zero padding becomes code 0."""
    codes = torch.arange(256, dtype=torch.uint8)
    back = codes.view(torch.float8_e8m0fnu).to(torch.bfloat16).to(torch.float8_e8m0fnu).view(torch.uint8)
    assert torch.equal(back, codes)
    assert int(torch.zeros(1, dtype=torch.bfloat16).to(torch.float8_e8m0fnu).view(torch.uint8)) == 0


def test_decode_refuses_nonzero_scale_padding(byte_moves):
    codes = np.full((200, 3), 127, dtype=np.uint8)
    np_, kp = mx.padded_nk(200, 96)
    stored = mx.permute_scales(codes, np_, kp)
    stored[-1, -1] = 127
    with pytest.raises(LayoutError, match="padding"):
        lay.decode_scales(stored, 200, 3, "s")


# --- real exports: validate, convert, verify per rank ---------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.conftest import run_cli

    base = tmp_path_factory.mktemp("mxfp4_marlin")
    biased = _with_bias(REAL / "llama-ct-mxfp4", base / "biased-src")
    made = {}
    for name, src in [*((n, REAL / n) for n in DENSE), ("biased", biased)]:
        for tp in (1, 2):
            r = run_cli("-q", "validate", src, "--target", "marlin", "--tp", tp)
            assert r.exit_code == 0, (name, tp, r.stdout, r.stderr)
            out = base / f"{name}-tp{tp}"
            r = run_cli("-q", "convert", src, "-o", out, "--target", "marlin", "--tp", tp)
            assert r.exit_code == 0, (name, tp, r.stderr)
            made[name, tp] = (src, out)
    return made


def _with_bias(src, dst):
    """llama-ct-mxfp4 with attention biases on q, k, v (random BF16): the fused qkv's bias path."""
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for name in [k for k in t if k.endswith(("q_proj.weight_packed", "k_proj.weight_packed", "v_proj.weight_packed"))]:
        t[name.replace("weight_packed", "bias")] = torch.randn(t[name].shape[0], generator=g).to(torch.bfloat16)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["attention_bias"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _verify(cli, out):
    r = cli("--json", "verify", out)
    assert r.exit_code in (0, 1), r.stderr
    return r.exit_code, r.json


@pytest.mark.parametrize("name", [*DENSE, "biased"])
@pytest.mark.parametrize("tp", [1, 2])
def test_untouched_output_verifies(cli, converted, name, tp):
    code, report = _verify(cli, converted[name, tp][1])
    failed = [(m["module"], m["rank"], m["message"]) for m in report["modules"] if not m["passed"]]
    assert code == 0 and not failed, failed
    assert {m["kind"] for m in report["modules"]} == {"mxfp4_marlin_linear"}
    assert len(report["modules"]) == 8 * tp
    assert not report["layout"]["problems"]


def test_bytes_match_the_reference(converted):
    """tp 1, every module (fused q/k/v and gate/up included): weight, E8M0 scales and bias against the
    reference applied to the source's concatenated tensors."""
    for name in (*DENSE, "biased"):
        src_dir, out = converted[name, 1]
        src = load_file(str(src_dir / "model.safetensors"))
        packed = "weight" if "quark" in name else "weight_packed"
        got = load_file(str(next(out.glob("model-*.safetensors"))))
        manifest = json.loads((out / "mocli-layout.json").read_text())
        for m in manifest["modules"]:
            meta = m["meta"]
            w = torch.cat([src[f"{s}.{packed}"] for s in m["sources"]])
            codes = torch.cat([src[f"{s}.weight_scale"] for s in m["sources"]])
            assert torch.equal(got[m["tensors"]["weight"]], ref.marlin_repack(w, meta["padded_n"], meta["padded_k"]))
            assert torch.equal(got[m["tensors"]["weight_scale"]],
                               ref.marlin_mxfp4_scales(codes, meta["padded_n"], meta["padded_k"]))
            if "bias" in m["tensors"]:
                b = torch.cat([src[f"{s}.bias"] for s in m["sources"]])
                assert torch.equal(got[m["tensors"]["bias"]], ref.marlin_bias(b, meta["padded_n"]))
        if name == "biased":
            assert sum("bias" in m["tensors"] for m in manifest["modules"]) == 2


def test_each_rank_holds_its_slice_of_the_layer(converted):
    """tp 2: each rank's decoded weight and scales are its manifest slice (rows of each column-parallel
    shard, K columns of a row-parallel layer) of the tp 1 layer, byte for byte."""
    _, one = converted["llama-ct-mxfp4", 1]
    _, two = converted["llama-ct-mxfp4", 2]
    whole = load_file(str(next(one.glob("model-*.safetensors"))))
    mods = {m["name"]: m for m in json.loads((one / "mocli-layout.json").read_text())["modules"]}
    ranks = json.loads((two / "mocli-layout.json").read_text())["ranks"]
    for name in (QKV, O_PROJ):
        meta = mods[name]["meta"]
        w1 = lay.decode_weight(whole[f"{name}.weight"].numpy(), meta["n"], meta["k"], name)
        s1 = lay.decode_scales(whole[f"{name}.weight_scale"].numpy(), meta["n"], meta["k"] // 32, name)
        offsets = np.cumsum([0, *meta["shard_rows"]])
        for rank in ranks:
            info = next(m for m in rank["modules"] if m["name"] == name)["meta"]
            t = load_file(str(next((two / rank["dir"]).glob("*.safetensors"))))
            w = lay.decode_weight(t[f"{name}.weight"].numpy(), info["n"], info["k"], name)
            sc = lay.decode_scales(t[f"{name}.weight_scale"].numpy(), info["n"], info["k"] // 32, name)
            rows = [(off + a, off + b, c0, c1) for off, (a, b, c0, c1) in zip(offsets, info["slices"], strict=False)]
            assert np.array_equal(w, np.concatenate([w1[a:b, c0 // 2:c1 // 2] for a, b, c0, c1 in rows]))
            assert np.array_equal(sc, np.concatenate([s1[a:b, c0 // 32:c1 // 32] for a, b, c0, c1 in rows]))


# --- planted faults: verify names each, on its module only ---------------------------------------------

def _halves(t):
    h = t.shape[-1] // 2
    return torch.cat([t[..., h:], t[..., :h]], dim=-1)


def _unpermuted(t):
    """The scales as the source's transposed codes: no 8x8 transpose, no [0, 2, 1, 3] swap."""
    return t.reshape(-1, 64)[:, torch.argsort(torch.tensor([i + 8 * j for i in range(8) for j in range(8)]))].reshape(t.shape)


def _bias_shift(t):
    return torch.roll(t, 1)


FAULTS = {  # (fixture, module, edit, words in the module's message)
    "scale halves swapped": ("llama-ct-mxfp4", QKV, lambda o: edit_tensor(o, f"{QKV}.weight_scale", _halves),
                             "weight_scale (E8M0 codes) differs"),
    "scales unpermuted": ("llama-ct-mxfp4", O_PROJ, lambda o: edit_tensor(o, f"{O_PROJ}.weight_scale", _unpermuted),
                          "weight_scale (E8M0 codes) differs"),
    "scale code +1": ("llama-quark-mxfp4", O_PROJ, lambda o: edit_tensor(o, f"{O_PROJ}.weight_scale", lambda t: t + 1),
                      "weight_scale (E8M0 codes) differs"),
    "weight words swapped": ("llama-ct-mxfp4a16", QKV, lambda o: edit_tensor(
        o, f"{QKV}.weight", lambda t: t.index_copy_(1, torch.tensor([0, 1]), t[:, [1, 0]].clone())), "weight differs"),
    "bias off by one row": ("biased", QKV, lambda o: edit_tensor(o, f"{QKV}.bias", _bias_shift), "bias differs"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_verify_names_a_planted_fault(cli, converted, tmp_path, fault):
    key, module, plant, says = FAULTS[fault]
    out = tmp_path / "o"
    shutil.copytree(converted[key, 1][1], out)
    plant(out)
    code, report = _verify(cli, out)
    assert code == 1
    failed = {m["module"]: m for m in report["modules"] if not m["passed"]}
    assert set(failed) == {module}, sorted(failed)
    assert says in failed[module]["message"], failed[module]["message"]


def test_nan_scale_is_refused(cli, real_copy, tmp_path):
    """E8M0 code 255 (NaN): convert names the tensor and writes nothing."""
    d = real_copy("llama-ct-mxfp4")
    edit_tensor(d, "model.layers.1.mlp.down_proj.weight_scale", lambda t: t.index_fill_(0, torch.tensor([3]), 255))
    out = tmp_path / "out"
    r = cli("convert", d, "-o", out, "--target", "marlin")
    assert r.exit_code != 0 and "model.layers.1.mlp.down_proj.weight_scale" in r.stderr and "0xFF" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
def test_mxfp4_linears_on_a_flashinfer_target_point_to_marlin(cli, target):
    r = cli("validate", REAL / "llama-ct-mxfp4", "--target", target)
    assert r.exit_code == 1 and "TGT002" in r.stdout and "marlin" in r.stdout


# --- experts ([w1; w3] halves: compressed-tensors, Quark's Qwen3-MoE) ------------------------------------

@pytest.fixture(scope="module")
def converted_moe(tmp_path_factory):
    return _validated_and_converted(tmp_path_factory.mktemp("mxfp4_marlin_moe"), MOE, ((1, 1), (2, 1), (2, 2)))


def _validated_and_converted(base, names, layouts) -> dict:
    """Each export at each (tp, ep): validate --target marlin is clean, then convert; the outputs by (name, tp, ep)."""
    from tests.conftest import run_cli

    made = {}
    for name in names:
        for tp, ep in layouts:
            r = run_cli("-q", "validate", REAL / name, "--target", "marlin", "--tp", tp, "--ep", ep)
            assert r.exit_code == 0, (name, tp, ep, r.stdout)
            out = base / f"{name}-tp{tp}-ep{ep}"
            r = run_cli("-q", "convert", REAL / name, "-o", out, "--target", "marlin", "--tp", tp, "--ep", ep)
            assert r.exit_code == 0, (name, tp, ep, r.stderr)
            made[name, tp, ep] = out
    return made


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_untouched_moe_output_verifies(cli, converted_moe, name, tp, ep):
    code, report = _verify(cli, converted_moe[name, tp, ep])
    failed = [(m["module"], m["rank"], m["message"]) for m in report["modules"] if not m["passed"]]
    assert code == 0 and not failed, failed
    assert {m["kind"] for m in report["modules"]} == {"mxfp4_marlin_linear", "mxfp4_marlin_moe"}
    assert sum(m["kind"] == "mxfp4_marlin_moe" for m in report["modules"]) == 2 * tp


def test_expert_bytes_match_the_reference(converted_moe):
    """tp 1: every expert's w13 is the reference repack of [w1; w3] (2I columns), its scales the reference
    chain on [w1; w3]'s codes, w2 and its scales likewise; the manifest says silu on halves."""
    for name in MOE:
        src = load_file(str(REAL / name / "model.safetensors"))
        packed = "weight" if "quark" in name else "weight_packed"
        out = converted_moe[name, 1, 1]
        got = load_file(str(next(out.glob("model-*.safetensors"))))
        mods = [m for m in json.loads((out / "mocli-layout.json").read_text())["modules"] if m["kind"] == "mxfp4_marlin_moe"]
        assert len(mods) == 2
        for m in mods:
            meta, t = m["meta"], m["tensors"]
            assert (meta["activation"], meta["w13_rows"], meta["padded_intermediate"]) == ("silu", "halves", meta["intermediate"])
            i, h = meta["intermediate"], meta["hidden"]
            for e in range(meta["experts"]):
                p = f"{m['name']}.{e}"
                w13 = torch.cat([src[f"{p}.gate_proj.{packed}"], src[f"{p}.up_proj.{packed}"]])
                s13 = torch.cat([src[f"{p}.gate_proj.weight_scale"], src[f"{p}.up_proj.weight_scale"]])
                assert torch.equal(got[t["w13_weight"]][e], ref.marlin_repack(w13, 2 * i, h))
                assert torch.equal(got[t["w13_weight_scale"]][e], ref.marlin_mxfp4_scales(s13, 2 * i, h))
                assert torch.equal(got[t["w2_weight"]][e], ref.marlin_repack(src[f"{p}.down_proj.{packed}"], h, i))
                assert torch.equal(got[t["w2_weight_scale"]][e], ref.marlin_mxfp4_scales(src[f"{p}.down_proj.weight_scale"], h, i))


def _expert_halves(t):
    """Expert 0's w13 scales with w1's and w3's columns swapped."""
    half = t.shape[-1] // 2
    t[0] = torch.cat([t[0, :, half:], t[0, :, :half]], dim=-1)
    return t


def _flip_expert_1(t):
    t[1, -1, -1] ^= 1
    return t


MOE_FAULTS = {
    "w1/w3 scale halves swapped": (lambda o: edit_tensor(o, f"{Q0}.w13_weight_scale", _expert_halves),
                                   "w13_weight_scale (expert 0) differs"),
    "w2 scales unpermuted": (lambda o: edit_tensor(o, f"{Q0}.w2_weight_scale", _unpermuted), "w2_weight_scale (expert"),
    # the weights' words: matched in C first (``weight_matches``), then decoded to say what differs
    "w1/w3 weight halves swapped": (lambda o: edit_tensor(o, f"{Q0}.w13_weight", _expert_halves),
                                    "w13_weight (expert 0) differs"),
    "one bit of expert 1's w2 words": (lambda o: edit_tensor(o, f"{Q0}.w2_weight", _flip_expert_1),
                                       "w2_weight (expert 1) differs"),
}


@pytest.mark.parametrize("fault", sorted(MOE_FAULTS))
def test_verify_names_a_planted_moe_fault(cli, converted_moe, tmp_path, fault):
    plant, says = MOE_FAULTS[fault]
    out = tmp_path / "o"
    shutil.copytree(converted_moe["qwen3_moe-ct-mxfp4", 1, 1], out)
    plant(out)
    code, report = _verify(cli, out)
    assert code == 1
    failed = {m["module"]: m for m in report["modules"] if not m["passed"]}
    assert set(failed) == {Q0}, sorted(failed)
    assert says in failed[Q0]["message"], failed[Q0]["message"]


def test_split_gpt_oss_experts_are_refused_by_validate_and_convert(cli, tmp_path):
    """llm-compressor's gpt-oss export (gate/up halves with biases, clamped SwiGLU) is not written for Marlin
    yet: validate and convert agree (TGT002, nothing written)."""
    name = "gpt_oss-ct-mxfp4a16"
    v = cli("validate", REAL / name, "--target", "marlin")
    assert v.exit_code == 1 and "TGT002" in v.stdout and "gate/up halves with biases" in v.stdout
    out = tmp_path / "out"
    r = cli("convert", REAL / name, "-o", out, "--target", "marlin")
    assert r.exit_code == 1 and "TGT002" in r.stderr and not out.exists()


# --- gpt-oss (native, Quark): interleaved gate_up, biases, the unequal 32-block split ------------------

@pytest.fixture(scope="module")
def converted_gpt_oss(tmp_path_factory):
    return _validated_and_converted(tmp_path_factory.mktemp("mxfp4_marlin_gpt_oss"), GPT_OSS[:2],
                                    ((1, 1), (2, 1), (2, 2), (4, 1)))


@pytest.mark.parametrize("name", GPT_OSS[:2])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_untouched_gpt_oss_output_verifies(cli, converted_gpt_oss, name, tp, ep):
    code, report = _verify(cli, converted_gpt_oss[name, tp, ep])
    failed = [(m["module"], m["rank"], m["message"]) for m in report["modules"] if not m["passed"]]
    assert code == 0 and not failed, failed
    assert sum(m["kind"] == "mxfp4_marlin_moe" for m in report["modules"]) == 2 * max(tp, ep)


def _gpt_oss_expert(src_dir, name, layer, e):
    """One expert's gate_up / down bytes and biases from the source file (the fused [E, ...] tensors of the
    native export, Quark's per-expert ones), read here with safetensors."""
    t = load_file(str(src_dir / "model.safetensors"))
    p = f"model.layers.{layer}.mlp.experts"
    if name == "gpt_oss-mxfp4":
        return {w: (t[f"{p}.{w}_proj_blocks"][e].reshape(t[f"{p}.{w}_proj_blocks"].shape[1], -1),
                    t[f"{p}.{w}_proj_scales"][e], t[f"{p}.{w}_proj_bias"][e]) for w in ("gate_up", "down")}
    return {w: (t[f"{p}.{e}.{w}_proj.weight"], t[f"{p}.{e}.{w}_proj.weight_scale"], t[f"{p}.{e}.{w}_proj.bias"])
            for w in ("gate_up", "down")}


@pytest.mark.parametrize("name", GPT_OSS[:2])
def test_gpt_oss_bytes_match_the_reference_per_rank(converted_gpt_oss, name):
    """tp 4 (I = 256: each rank 64 rows of 32-blocks, padded to Ip = 128): each rank's expert bytes equal the
    reference applied to its rows copied into the start of vLLM's padded parameters (zeros; Quark's scale
    padding 1), interleaved rows kept; the down bias on rank 0 only."""
    out = converted_gpt_oss[name, 4, 1]
    ranks = json.loads((out / "mocli-layout.json").read_text())["ranks"]
    pad = 1 if "quark" in name else 0
    for rank in ranks:
        t = load_file(str(next((out / rank["dir"]).glob("*.safetensors"))))
        m = next(x for x in rank["modules"] if x["name"] == "model.layers.1.mlp.experts")
        meta, r = m["meta"], rank["tp_rank"]
        ip, hp, i0 = meta["padded_intermediate"], meta["padded_hidden"], 64 * r
        assert (ip, hp, meta["intermediate"], meta["w13_rows"]) == (128, 256, 64, "interleaved")
        for e in range(meta["experts"]):
            (w13, s13, b13), (w2, s2, b2) = _gpt_oss_expert(REAL / name, name, 1, e).values()
            pw = torch.zeros(2 * ip, hp // 2, dtype=torch.uint8)
            pw[:128] = w13[2 * i0:2 * i0 + 128]
            ps = torch.full((2 * ip, hp // 32), pad, dtype=torch.uint8)
            ps[:128] = s13[2 * i0:2 * i0 + 128]
            assert torch.equal(t[m["tensors"]["w13_weight"]][e], ref.marlin_repack(pw, 2 * ip, hp))
            assert torch.equal(t[m["tensors"]["w13_weight_scale"]][e], ref.marlin_mxfp4_scales(ps, 2 * ip, hp))
            pb = torch.zeros(2 * ip, dtype=torch.bfloat16)
            pb[:128] = b13[2 * i0:2 * i0 + 128].to(torch.bfloat16)
            assert torch.equal(t[m["tensors"]["w13_bias"]][e], ref.marlin_bias(pb, 2 * ip))
            pw2 = torch.zeros(hp, ip // 2, dtype=torch.uint8)
            pw2[:, :32] = w2[:, i0 // 2:i0 // 2 + 32]
            ps2 = torch.full((hp, ip // 32), pad, dtype=torch.uint8)
            ps2[:, :2] = s2[:, i0 // 32:i0 // 32 + 2]
            assert torch.equal(t[m["tensors"]["w2_weight"]][e], ref.marlin_repack(pw2, hp, ip))
            assert torch.equal(t[m["tensors"]["w2_weight_scale"]][e], ref.marlin_mxfp4_scales(ps2, hp, ip))
            want_b2 = b2.to(torch.bfloat16) if r == 0 else torch.zeros_like(b2, dtype=torch.bfloat16)
            assert torch.equal(t[m["tensors"]["w2_bias"]][e], ref.marlin_bias(want_b2, hp))


G0 = "model.layers.0.mlp.experts"
GPT_OSS_FAULTS = {  # (tp, edit on rank dir or output, words)
    "w13 bias off by one row": (1, lambda o: edit_tensor(o, f"{G0}.w13_bias", lambda t: torch.roll(t, 1, dims=-1)),
                                "w13_bias (expert"),
    "down bias on rank 1": (2, lambda o: edit_tensor(o / "rank-1", f"{G0}.w2_bias", lambda t: t + 1), "w2_bias (expert"),
    "scale padding not the parameter's": (4, lambda o: edit_tensor(o / "rank-0", f"{G0}.w2_weight_scale",
                                                                    lambda t: t.index_fill_(1, torch.tensor([3]), 9)),
                                          "padding"),
    "interleave undone": (1, lambda o: edit_tensor(o, f"{G0}.w13_weight_scale", _expert_halves), "w13_weight_scale (expert 0)"),
}


@pytest.mark.parametrize("fault", sorted(GPT_OSS_FAULTS))
def test_verify_names_a_planted_gpt_oss_fault(cli, converted_gpt_oss, tmp_path, fault):
    tp, plant, says = GPT_OSS_FAULTS[fault]
    out = tmp_path / "o"
    shutil.copytree(converted_gpt_oss["gpt_oss-mxfp4", tp, 1], out)
    plant(out)
    code, report = _verify(cli, out)
    assert code == 1
    failed = {m["module"]: m for m in report["modules"] if not m["passed"]}
    assert set(failed) == {G0}, sorted(failed)
    assert says in failed[G0]["message"], failed[G0]["message"]
