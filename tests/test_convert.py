"""convert: every transform against a second, straightforward implementation (tests/reference.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from fixtures.generate import make_broken, make_checkpoint
from mocli.loader import Fp8Linear, Fp8MoE, Nvfp4Linear, Nvfp4MoE, load_converted
from tests import reference as ref
from tests.conftest import REAL_LLAMA, REAL_QWEN, digest_tree, u8

TARGETS = ["flashinfer-cutlass", "flashinfer-trtllm"]


def convert(cli, src, out, target, *extra):
    r = cli("--json", "convert", src, "-o", out, "--target", target, *extra)
    assert r.exit_code == 0, r.stderr
    return r.json


def load_out(out):
    t = {}
    for f in sorted(out.glob("model-*.safetensors")):
        t |= load_file(str(f))
    return t


def same(a, b):
    return a.shape == b.shape and torch.equal(u8(a).reshape(-1), u8(b).reshape(-1))


def rescale(bs, s2, big):
    return (bs.float() * s2 / big).clamp(-448, 448).to(torch.float8_e4m3fn) if s2 != big else bs


@pytest.mark.parametrize("target", TARGETS)
def test_real_fp8_llama_dense(cli, tmp_path, target):
    summary = convert(cli, REAL_LLAMA, tmp_path / "o", target)
    src, out = load_file(str(REAL_LLAMA / "model.safetensors")), load_out(tmp_path / "o")
    for layer in range(2):
        for fused, shards in (("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                              ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"])):
            p = f"model.layers.{layer}."
            s = [src[p + x + ".weight_scale"] for x in shards]
            big = torch.stack(s).max()
            want = torch.cat([src[p + x + ".weight"] if si == big else ref.fp8_requant(src[p + x + ".weight"], si, big)
                              for x, si in zip(shards, s, strict=True)])
            assert same(out[p + fused + ".weight"], want)
            assert out[p + fused + ".weight_scale"] == big
            assert out[p + fused + ".input_scale"] == max(src[p + x + ".input_scale"] for x in shards)
        assert same(out[f"model.layers.{layer}.mlp.down_proj.weight"], src[f"model.layers.{layer}.mlp.down_proj.weight"])
    # q/k/v and gate/up scales differ in the real export: all but the max shard get requantized
    assert summary["unified_scales"]["fp8_requantized_shards"] == 2 * (2 + 1)
    assert summary["repairs"] == summary["unified_scales"]  # the old key, kept one release (README)
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.1.self_attn.k_proj.k_scale",
                 "model.layers.0.self_attn.v_proj.v_scale"):
        assert same(out[name], src[name])


@pytest.mark.parametrize("target", TARGETS)
def test_real_nvfp4_qwen3_moe(cli, tmp_path, target):
    convert(cli, REAL_QWEN, tmp_path / "o", target)
    src, out = load_file(str(REAL_QWEN / "model.safetensors")), load_out(tmp_path / "o")
    trt = target == "flashinfer-trtllm"
    p = "model.layers.1.mlp.experts"
    e_count, i, h = 8, 128, 256
    a13 = max(float(src[f"{p}.{e}.{x}.input_scale"]) for e in range(e_count) for x in ("gate_proj", "up_proj"))
    a2 = max(float(src[f"{p}.{e}.down_proj.input_scale"]) for e in range(e_count))
    for e in range(e_count):
        sp = f"{p}.{e}."
        s1, s3 = float(src[sp + "gate_proj.weight_scale_2"]), float(src[sp + "up_proj.weight_scale_2"])
        big = max(s1, s3)
        w13 = torch.cat([src[sp + "up_proj.weight"], src[sp + "gate_proj.weight"]])  # [w3; w1]
        bs13 = torch.cat([rescale(src[sp + "up_proj.weight_scale"], s3, big),
                          rescale(src[sp + "gate_proj.weight_scale"], s1, big)])
        w2, bs2 = src[sp + "down_proj.weight"], src[sp + "down_proj.weight_scale"]
        if trt:
            w13, bs13 = ref.shuffle_rows(ref.gated_reorder(w13)), ref.shuffle_rows(ref.gated_reorder(bs13))
            w2, bs2 = ref.shuffle_rows(w2), ref.shuffle_rows(bs2)
        assert same(out[p + ".w13_weight"][e], w13)
        assert same(out[p + ".w13_weight_scale"][e], ref.swizzle_by_offsets(bs13))
        assert same(out[p + ".w2_weight"][e], w2)
        assert same(out[p + ".w2_weight_scale"][e], ref.swizzle_by_offsets(bs2))
        assert float(out[p + ".w13_weight_scale_2"][e]) == big
        assert float(out[p + ".g1_alphas"][e]) == pytest.approx(big * a13, rel=1e-6)
        assert float(out[p + ".g2_alphas"][e]) == pytest.approx(float(src[sp + "down_proj.weight_scale_2"]) * a2,
                                                                 rel=1e-6)
    assert torch.allclose(out[p + ".a1_gscale"], torch.full((e_count,), 1 / a13))
    assert torch.allclose(out[p + ".a2_gscale"], torch.full((e_count,), 1 / a2))
    assert out[p + ".w13_weight_scale"].shape == (e_count, 2 * i, h // 16)  # 256 rows, 16 cols: no padding
    if trt:
        assert torch.allclose(out[p + ".output1_scale_scalar"], out[p + ".g1_alphas"] / a2)
    # dense NVFP4 qkv
    q = "model.layers.0.self_attn."
    w = torch.cat([src[q + x + "_proj.weight"] for x in "qkv"])
    bs = torch.cat([src[q + x + "_proj.weight_scale"] for x in "qkv"])
    if trt:
        w, bs = ref.shuffle_rows(w), ref.shuffle_rows(bs)
    assert same(out[q + "qkv_proj.weight"], w)
    assert same(out[q + "qkv_proj.weight_scale"], ref.swizzle_by_offsets(bs))
    a = max(float(src[q + x + "_proj.input_scale"]) for x in "qkv")
    assert float(out[q + "qkv_proj.alpha"]) == pytest.approx(a * float(src[q + "q_proj.weight_scale_2"]), rel=1e-6)
    assert float(out[q + "qkv_proj.input_scale_inv"]) == pytest.approx(1 / a, rel=1e-6)
    assert same(out["model.layers.0.mlp.gate.weight"], src["model.layers.0.mlp.gate.weight"])


def test_nvfp4_scale_2_mismatch_is_rescaled_and_dequantizes_close(cli, tmp_path):
    path, _ = make_broken("SCL005", tmp_path / "src")  # w1/w3 and q/k/v weight_scale_2 differ
    summary = convert(cli, path, tmp_path / "o", "flashinfer-cutlass")
    r = summary["unified_scales"]
    assert r["nvfp4_rescaled_experts"] == 8 and r["nvfp4_rescaled_shards"] > 0 and r["nvfp4_worst_scale_2_ratio"] > 1
    src, out = load_file(str(path / "model.safetensors")), load_out(tmp_path / "o")
    p, i, h = "model.layers.0.mlp.experts", 128, 128
    for e in range(4):
        big = float(out[p + ".w13_weight_scale_2"][e])
        bs = ref.unswizzle_by_offsets(out[p + ".w13_weight_scale"][e], 2 * i, h // 16).view(torch.float8_e4m3fn)
        got = ref.dequant_nvfp4(out[p + ".w13_weight"][e], bs, big)
        for half, proj in ((slice(0, i), "up_proj"), (slice(i, 2 * i), "gate_proj")):
            sp = f"{p}.{e}.{proj}."
            want = ref.dequant_nvfp4(src[sp + "weight"], src[sp + "weight_scale"], float(src[sp + "weight_scale_2"]))
            # exact for the max half; within one fp8 rounding of the block scale (2^-4 relative) otherwise
            assert torch.allclose(got[half], want, rtol=2.0**-4, atol=0)


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_moe_mixtral(cli, tmp_path, target):
    path = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8")
    convert(cli, path, tmp_path / "o", target)
    src, out = load_file(str(path / "model.safetensors")), load_out(tmp_path / "o")
    p = "model.layers.1.block_sparse_moe.experts"
    a1 = max(float(src[f"{p}.{e}.{w}.input_scale"]) for e in range(4) for w in ("w1", "w3"))
    a2 = max(float(src[f"{p}.{e}.w2.input_scale"]) for e in range(4))
    for e in range(4):
        s1, s3 = src[f"{p}.{e}.w1.weight_scale"], src[f"{p}.{e}.w3.weight_scale"]
        big = torch.maximum(s1, s3)
        w13 = torch.cat([ref.fp8_requant(src[f"{p}.{e}.w3.weight"], s3, big) if s3 != big else src[f"{p}.{e}.w3.weight"],
                         ref.fp8_requant(src[f"{p}.{e}.w1.weight"], s1, big) if s1 != big else src[f"{p}.{e}.w1.weight"]])
        w2 = src[f"{p}.{e}.w2.weight"]
        if target == "flashinfer-trtllm":
            w13, w2 = ref.shuffle_rows(ref.gated_reorder(w13)), ref.shuffle_rows(w2)
        assert same(out[p + ".w13_weight"][e], w13) and same(out[p + ".w2_weight"][e], w2)
        assert out[p + ".w13_weight_scale"][e] == big
        assert float(out[p + ".g1_alphas"][e]) == pytest.approx(float(big) * a1, rel=1e-6)
        assert float(out[p + ".g2_alphas"][e]) == pytest.approx(float(src[f"{p}.{e}.w2.weight_scale"]) * a2, rel=1e-6)
    assert float(out[p + ".w13_input_scale"]) == a1 and out[p + ".w13_input_scale"].shape == ()
    assert float(out[p + ".w2_input_scale_inv"]) == pytest.approx(1 / a2, rel=1e-6)


def test_per_channel_and_block_fp8_concatenate(cli, tmp_path):
    for algo in ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
        path = make_checkpoint(tmp_path / algo, algo=algo)
        convert(cli, path, tmp_path / f"o-{algo}", "flashinfer-cutlass")
        src, out = load_file(str(path / "model.safetensors")), load_out(tmp_path / f"o-{algo}")
        p = "model.layers.0.mlp."
        assert same(out[p + "gate_up_proj.weight"], torch.cat([src[p + "gate_proj.weight"], src[p + "up_proj.weight"]]))
        ws = out[p + "gate_up_proj.weight_scale"]
        if algo == "FP8_PB_WO":
            assert ws.shape == (512 // 128, 128 // 128)
            want = torch.cat([src[p + "gate_proj.weight_scale"].reshape(2, 1), src[p + "up_proj.weight_scale"].reshape(2, 1)])
        else:
            want = torch.cat([src[p + "gate_proj.weight_scale"], src[p + "up_proj.weight_scale"]])
        assert torch.equal(ws, want)


def test_nvfp4_dense_cutlass_padding(cli, tmp_path):
    # heads*head_dim = 48: K of o_proj = 48 -> padded to 64; N of q = 48 -> 64 rows
    path = make_checkpoint(tmp_path / "src", algo="NVFP4", heads=1, kv_heads=1, head_dim=48)
    convert(cli, path, tmp_path / "o", "flashinfer-cutlass")
    src, out = load_file(str(path / "model.safetensors")), load_out(tmp_path / "o")
    w = out["model.layers.0.self_attn.o_proj.weight"]
    assert w.shape == (128, 32)  # [N=128, roundup(48, 32)/2]
    assert same(w[:, :24], src["model.layers.0.self_attn.o_proj.weight"]) and not w[:, 24:].any()
    qkv = out["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (160, 64) and not qkv[144:].any()
    info = load_converted(tmp_path / "o").modules["model.layers.0.self_attn.o_proj"]
    assert (info.n, info.k, info.padded_n, info.padded_k) == (128, 48, 128, 64)


def test_mixed_precision_each_module_by_its_scheme(cli, tmp_path):
    path = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="MIXED_PRECISION",
                           mixed={"self_attn": "FP8", "experts": "NVFP4"})
    convert(cli, path, tmp_path / "o", "flashinfer-cutlass")
    ck = load_converted(tmp_path / "o")
    assert isinstance(ck.modules["model.layers.0.self_attn.qkv_proj"], Fp8Linear)
    assert isinstance(ck.modules["model.layers.0.mlp.experts"], Nvfp4MoE)


def test_loader_builds_kernel_arguments(cli, tmp_path):
    convert(cli, REAL_QWEN, tmp_path / "o", "flashinfer-cutlass")
    ck = load_converted(tmp_path / "o")
    moe = ck.modules["model.layers.0.mlp.experts"]
    qs = moe.cutlass_quant_scales()
    assert [tuple(x.shape) for x in qs] == [(8,), (8, 256, 4), (8,), (8,), (8, 256, 2), (8,)]
    assert qs[1].dtype == torch.int32
    lin = ck.modules["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(lin, Nvfp4Linear) and lin.n == 512 and lin.k == 256 and lin.shard_rows == [256, 128, 128]
    assert ck.provenance["target"] == "flashinfer-cutlass"
    fp8 = load_converted(convert_fp8(cli, tmp_path)).modules["model.layers.0.block_sparse_moe.experts"]
    assert isinstance(fp8, Fp8MoE)
    s = fp8.cutlass_quant_scales()
    assert s[0].shape == (4,) and s[1].shape == () and s[3].shape == ()


def convert_fp8(cli, tmp_path):
    path = make_checkpoint(tmp_path / "fp8src", arch="mixtral", algo="FP8")
    convert(cli, path, tmp_path / "fp8out", "flashinfer-cutlass")
    return tmp_path / "fp8out"


# --- output files, provenance, safety ---------------------------------------------------------------


def test_output_files_index_manifest_provenance(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", shards=2)
    convert(cli, src, tmp_path / "o", "flashinfer-trtllm", "--max-shard-size", "300KB")
    out = tmp_path / "o"
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(f"-of-{len(shards):05d}" in s.name for s in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_out(out))
    manifest = json.loads((out / "mocli-layout.json").read_text())
    assert manifest["layout_version"] == 2 and manifest["target"] == "flashinfer-trtllm"
    w13 = manifest["tensors"]["model.layers.0.mlp.experts.w13_weight"]
    assert w13["role"] == "w13_weight" and "rows_w3_w1" in w13["transforms"] and len(w13["sources"]) == 8
    # config.json declares the layout, not ModelOpt: an engine without mocli's plugin refuses it
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "mocli" and q["layout_version"] == 2 and q["target"] == "flashinfer-trtllm"
    assert q["source_quantization_config"]["quant_method"] == "modelopt"
    assert q["source_hf_quant_config"] == json.loads((src / "hf_quant_config.json").read_text())
    assert not (out / "hf_quant_config.json").exists()
    prov = q["mocli"]
    assert prov == manifest["provenance"]
    assert prov["source_shards"] == {p.name: {"xxh3_128": xxhash.xxh3_128(p.read_bytes()).hexdigest()}
                                     for p in sorted(src.glob("*.safetensors"))}
    # every file but the manifest is covered by a digest
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"mocli-layout.json"}
    assert set(manifest["files"]) == on_disk
    assert all(manifest["files"][f] == {"size": (out / f).stat().st_size,
                                        "xxh3_128": xxhash.xxh3_128((out / f).read_bytes()).hexdigest()} for f in on_disk)


def test_reruns_are_byte_identical_and_input_untouched(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", shards=2)
    before = digest_tree(src)
    convert(cli, src, tmp_path / "a", "flashinfer-cutlass")
    convert(cli, src, tmp_path / "b", "flashinfer-cutlass")
    assert digest_tree(tmp_path / "a") == digest_tree(tmp_path / "b")
    assert digest_tree(src) == before


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("arch,algo", [("qwen3_moe", "NVFP4"), ("mixtral", "FP8"), ("llama", "FP8"), ("llama", "NVFP4")])
def test_inputs_mapped_or_read_give_the_same_bytes(cli, tmp_path, monkeypatch, arch, algo, target):
    """The suite maps every input (conftest), as a real checkpoint's weights are; its small tensors
    are read into buffers instead. Both give the same output, and the maps never reach the source."""
    src = make_checkpoint(tmp_path / "src", arch=arch, algo=algo, unify_scale_2=False, shards=2)
    before = digest_tree(src)
    convert(cli, src, tmp_path / "mapped", target)
    monkeypatch.setattr("mocli.stream.pool.MAP_MIN", 1 << 62)
    convert(cli, src, tmp_path / "read", target)
    assert digest_tree(tmp_path / "mapped") == digest_tree(tmp_path / "read")
    assert digest_tree(src) == before


def test_refuses_non_empty_output_unless_overwrite(cli, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = cli("convert", REAL_LLAMA, "-o", out, "--target", "flashinfer-cutlass")
    assert r.exit_code == 2 and "not empty" in r.stderr and (out / "keep.txt").exists()
    convert(cli, REAL_LLAMA, out, "flashinfer-cutlass", "--overwrite")
    assert not (out / "keep.txt").exists() and (out / "mocli-layout.json").exists()


def test_refuses_checkpoint_that_fails_validation(cli, tmp_path):
    path, _ = make_broken("TGT001", tmp_path / "src")  # 2I = 192 is not a multiple of 128
    r = cli("convert", path, "-o", tmp_path / "o", "--target", "flashinfer-cutlass")
    assert r.exit_code == 1 and "TGT001" in r.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_cuda_without_gpu_and_bad_size_are_usage_errors(cli, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = cli("convert", REAL_LLAMA, "-o", tmp_path / "o", "--target", "flashinfer-cutlass", "--device", "cuda")
    assert r.exit_code == 2 and "CUDA" in r.stderr
    r = cli("convert", REAL_LLAMA, "-o", tmp_path / "o", "--target", "flashinfer-cutlass", "--max-shard-size", "lots")
    assert r.exit_code == 2 and "max-shard-size" in r.stderr


@pytest.mark.parametrize("visible,count", [(None, 2), ("", 0), ("1", 1), ("1,0", 2), ("0,7,1", 1), ("GPU-8c1f", 1)])
def test_visible_gpus_from_proc_and_cuda_visible_devices(tmp_path, monkeypatch, visible, count):
    """The count a conversion's --device check takes without starting the CUDA driver: /proc's GPUs as
    CUDA_VISIBLE_DEVICES narrows them (the list ends at an index out of range); None where /proc is silent."""
    from mocli import devices

    for pci in ("0000:00:06.0", "0000:00:07.0"):
        (tmp_path / pci).mkdir()
    monkeypatch.setattr(devices, "PROC_GPUS", str(tmp_path))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.visible_gpus() == count
    monkeypatch.setattr(devices, "PROC_GPUS", str(tmp_path / "none"))
    assert devices.visible_gpus() is None


@pytest.mark.parametrize("gpus", [1, 0])
def test_convert_device_cuda_never_starts_the_cuda_driver(cli, tmp_path, monkeypatch, gpus):
    """--device cuda is checked against /proc's GPUs where it lists them; the driver library is never
    loaded (cuInit cost an H200 host 0.1 s of a conversion that never uses the GPU)."""
    import ctypes

    from mocli import devices

    for i in range(gpus):
        (tmp_path / "gpus" / f"0000:00:0{i}.0").mkdir(parents=True)
    (tmp_path / "gpus").mkdir(exist_ok=True)
    monkeypatch.setattr(devices, "PROC_GPUS", str(tmp_path / "gpus"))
    monkeypatch.setattr(devices, "_probes", {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    loaded = []
    real = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: loaded.append(name) or real(name, *a, **k))
    r = cli("--json", "convert", REAL_LLAMA, "-o", tmp_path / "o", "--target", "flashinfer-cutlass", "--device", "cuda")
    if gpus:
        assert r.exit_code == 0 and (r.json["device"], r.json["device_requested"]) == ("cpu", "cuda:0"), r.stderr
    else:
        assert r.exit_code == 2 and "no CUDA device is available" in r.stderr and not (tmp_path / "o").exists()
    assert not [n for n in loaded if "libcuda" in str(n)]


class _Ran(Exception):
    pass


@pytest.mark.parametrize("arch,algo,target,tp", [
    ("qwen3_moe", "NVFP4", "flashinfer-cutlass", 1), ("llama", "NVFP4", "flashinfer-cutlass", 1),
    ("qwen3_moe", "NVFP4", "flashinfer-trtllm", 1), ("llama", "NVFP4", "flashinfer-trtllm", 1),
    ("qwen3_moe", "NVFP4", "flashinfer-cutlass", 2),  # w2's columns sliced per rank in memory
    ("padded", "NVFP4", "flashinfer-cutlass", 1),  # N = 48 padded to 128 in memory
    ("mixtral", "FP8", "flashinfer-cutlass", 1), ("mixtral", "FP8", "flashinfer-trtllm", 2),
    ("llama", "FP8", "flashinfer-cutlass", 2), ("llama", "FP8_PB_WO", "flashinfer-trtllm", 1),
    ("llama", "FP8_PER_CHANNEL_PER_TOKEN", "flashinfer-cutlass", 2)])
def test_every_conversion_plan_is_torch_free(tmp_path, arch, algo, target, tp):
    """A conversion only moves bytes: NVFP4 (copied in the kernel, or shuffled, sliced, padded and its
    block scales rescaled) and FP8 (NaN checks, shards and w1/w3 halves requantized through a table,
    rows shuffled) alike, every target and layout: all its units are torch-free, so the engine never
    loads torch (``test_convert_and_verify_run_without_torch`` runs it so)."""
    from mocli.checkpoint import open_checkpoint

    shape = dict(arch="llama", heads=1, kv_heads=1, head_dim=48) if arch == "padded" else dict(arch=arch)
    ckpt = open_checkpoint(str(make_checkpoint(tmp_path / "src", algo=algo, **shape)))
    plan = build_plan_for(ckpt, target, tp)
    assert plan.units and all(u.torch_free for u in plan.units)
    assert plan.compute == (algo != "NVFP4")  # FP8 reads every weight byte (its NaN checks)


def build_plan_for(ckpt, target: str, tp: int):
    from mocli.census import build_census
    from mocli.parallel import Heads, ParallelLayout
    from mocli.plan import build_plan
    from mocli.scales import read_scales
    from mocli.targets import Target

    census = build_census(ckpt.tensors)
    return build_plan(census, read_scales(census), Target(target), ParallelLayout(tp, 1), Heads.from_config(ckpt.config))


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("arch,algo", [("qwen3_moe", "NVFP4"), ("llama", "NVFP4"), ("mixtral", "FP8"), ("llama", "FP8")])
def test_conversion_under_device_cuda_runs_on_the_cpu(cli, tmp_path, monkeypatch, arch, algo, target):
    """The whole run with --device cuda taken as granted: on a machine without CUDA anything that
    touched it (pinned buffers, a copy to the device) would fail. It says where it ran, and the bytes
    are those of --device cpu."""
    import mocli.devices

    extra = dict(unify_scale_2=False) if algo == "NVFP4" else {}
    src = make_checkpoint(tmp_path / "src", arch=arch, algo=algo, **extra)
    plain = convert(cli, src, tmp_path / "cpu", target, "--device", "cpu")
    assert plain["device"] == "cpu" and "device_requested" not in plain
    monkeypatch.setattr(mocli.devices, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(mocli.devices, "check_device", lambda d: None)
    monkeypatch.setattr(mocli.devices, "requested_device", lambda d: "cuda")
    r = convert(cli, src, tmp_path / "cuda", target, "--device", "cuda")
    assert (r["device"], r["device_requested"]) == ("cpu", "cuda")
    assert digest_tree(tmp_path / "cuda") == digest_tree(tmp_path / "cpu")
    human = cli("convert", src, "-o", tmp_path / "again", "--target", target, "--device", "cuda")
    assert human.exit_code == 0
    assert "ran on cpu, not cuda: a conversion only moves bytes" in " ".join(human.stdout.split())


def test_output_inside_input_is_refused(cli, real_copy):
    src = real_copy("llama-fp8_kv")
    r = cli("convert", src, "-o", src / "out", "--target", "flashinfer-cutlass")
    assert r.exit_code == 2 and "overlaps" in r.stderr


def test_converted_output_is_not_taken_as_a_source(cli, tmp_path):
    convert(cli, REAL_LLAMA, tmp_path / "o", "flashinfer-cutlass")
    for cmd in (["inspect"], ["validate"], ["convert", "-o", str(tmp_path / "again"), "--target", "flashinfer-cutlass"]):
        r = cli(cmd[0], tmp_path / "o", *cmd[1:])
        assert r.exit_code == 2 and "mocli-converted" in r.stderr


def test_loader_hands_over_the_pass_through_tensors_with_the_source_bytes(cli, tmp_path):
    """load_converted(everything) gives a serving process the whole rank: the modules plus every other
    tensor, bytes as in the source (read here with the safetensors library, not mocli)."""
    from safetensors.torch import load_file

    convert(cli, REAL_QWEN, tmp_path / "o", "flashinfer-cutlass")
    ck = load_converted(tmp_path / "o")
    src = {}
    for f in sorted(REAL_QWEN.glob("*.safetensors")):
        src |= load_file(f)
    in_modules = {t for m in ck.layout.modules for t in m.tensors.values()}
    prefixes = tuple(s + "." for m in ck.layout.modules for s in [m.name, *m.sources])
    roles = {"weight", "weight_scale", "weight_scale_2", "input_scale", "bias"}  # what a module consumes
    expected = {n for n in src if not (n.startswith(prefixes) and n.rsplit(".", 1)[1] in roles)}
    assert "model.layers.0.self_attn.k_proj.k_scale" in expected  # KV-cache scales pass through
    assert set(ck.passthrough) == expected and expected and not set(ck.passthrough) & in_modules
    for n, t in ck.passthrough.items():
        assert t.dtype == src[n].dtype and t.shape == src[n].shape
        assert torch.equal(t.reshape(-1).view(torch.uint8), src[n].reshape(-1).view(torch.uint8))
    assert load_converted(tmp_path / "o", modules=["model.layers.0.mlp.experts"]).passthrough == {}


WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch fails from here on
from mocli.cli import main
sys.argv = ["mocli", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("par", [(), ("--tp", "2", "--ep", "2")])
def test_convert_and_verify_run_without_torch(cli, tmp_path, target, par):
    """``mocli convert`` and ``mocli verify`` in fresh processes where torch cannot be imported, under
    --device auto. Converting never loads it (``mocli.ops``): the real NVFP4 MoE export and the real
    FP8 export both convert and say they ran on the CPU. Verifying NVFP4 never loads it either
    (``mocli.verify.kinds``): the output verifies, and a flipped bit in it fails. The FP8 output
    verifies with torch (in this process) and fails without it - FP8 GEMMs are torch's - which shows
    torch really was unimportable there."""
    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, cwd=root)
    r = run("convert", REAL_QWEN, "-o", tmp_path / "o", "--target", target, *par, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["device"] == "cpu"
    v = run("verify", tmp_path / "o", "--json")
    assert v.returncode == 0, v.stderr + v.stdout[-2000:]
    report = json.loads(v.stdout)
    assert report["ok"] and report["device"] == "cpu" and report["modules"]
    assert all(m["emulated"] and m["kernel"].startswith("emulated NVFP4") for m in report["modules"])
    shard = sorted((tmp_path / "o").rglob("model-*.safetensors"))[-1]
    with open(shard, "r+b") as f:  # one bit of the last shard's last tensor (the data section's end)
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0x10]))
    bad = run("verify", tmp_path / "o", "--json")
    assert bad.returncode == 1 and not json.loads(bad.stdout)["ok"], bad.stderr
    fp8 = run("convert", REAL_LLAMA, "-o", tmp_path / "fp8", "--target", target, *par[:2], "--json")  # dense: no --ep
    assert fp8.returncode == 0 and json.loads(fp8.stdout)["device"] == "cpu", fp8.stderr
    assert cli("verify", tmp_path / "fp8").exit_code == 0
    fp8v = run("verify", tmp_path / "fp8")
    assert fp8v.returncode != 0 and "torch" in fp8v.stderr


BLAS_AT_NUMPY_IMPORT = """
import importlib.abc, os, sys
seen = []


class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not seen:
            seen.append(os.environ.get("OPENBLAS_NUM_THREADS"))
            # said at once: the program exits without interpreter teardown (mocli.cli.main), so no finally runs
            sys.stderr.write(f"OPENBLAS_NUM_THREADS at numpy's import: {seen}\\n")
            sys.stderr.flush()
        return None


sys.meta_path.insert(0, Watch())
from mocli.cli import main
sys.argv = ["mocli", *sys.argv[1:]]
main()
"""


def test_convert_and_verify_set_one_blas_thread_before_numpy_loads(tmp_path):
    """OpenBLAS reads OPENBLAS_NUM_THREADS once, when numpy loads it: convert (no GEMM; its workers only
    spun) and verify (GEMMs of 64 rows beside hashing threads) must set it before the first numpy import,
    in a fresh process as a user runs them, and keep a value the user chose."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}

    def run(*a, **extra):
        r = subprocess.run([sys.executable, "-c", BLAS_AT_NUMPY_IMPORT, *map(str, a)], capture_output=True,
                           text=True, cwd=root, env={**env, **extra})
        assert r.returncode == 0, r.stderr
        return next(line for line in r.stderr.splitlines() if line.startswith("OPENBLAS_NUM_THREADS at numpy"))

    assert run("-q", "convert", REAL_QWEN, "-o", tmp_path / "o", "--target", "flashinfer-trtllm").endswith("['1']")
    assert run("-q", "verify", tmp_path / "o").endswith("['1']")
    assert run("-q", "verify", tmp_path / "o", OPENBLAS_NUM_THREADS="3").endswith("['3']")


FRESH_PAGES_AFTER_MAIN = """
import ctypes, sys
from mocli.cli import main


class Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype, libc.malloc.argtypes = Mallinfo2, ctypes.c_void_p, [ctypes.c_size_t]
try:
    main(sys.argv[1:])  # with argv: returns by SystemExit, the interpreter kept (cli.main)
except SystemExit as e:
    if e.code:
        raise
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
sys.stderr.write(f"fresh maps for a 64 MiB block: {libc.mallinfo2().hblks - before}\\n")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's malloc")
def test_convert_and_quantize_reuse_freed_memory(tmp_path):
    """convert and quantize make an array per unit (an NVFP4 trtllm expert's gathered rows: 6.3 MB on the
    bench checkpoint); they set glibc's malloc to keep such blocks in the heap for the next unit instead
    of mapping fresh, zeroed pages for each (``procenv.reuse_freed_memory``). Watched in a fresh process
    as a user runs them: after the command, a 64 MiB block comes from the heap. glibc maps any block over
    32 MiB by itself, which the bare interpreter shows."""
    root = Path(__file__).resolve().parents[1]

    def fresh_maps(*a):
        r = subprocess.run([sys.executable, "-c", FRESH_PAGES_AFTER_MAIN, *map(str, a)], capture_output=True,
                           text=True, cwd=root)
        assert r.returncode == 0, r.stderr
        return r.stderr.strip().splitlines()[-1]

    assert fresh_maps("--version") == "fresh maps for a 64 MiB block: 1"  # the default, to tell them apart
    assert fresh_maps("-q", "convert", REAL_QWEN, "-o", tmp_path / "o", "--target", "flashinfer-trtllm") == \
        "fresh maps for a 64 MiB block: 0"
    src = make_checkpoint(tmp_path / "bf16", arch="qwen3_moe", algo="BF16", kv_cache=False)
    assert fresh_maps("-q", "quantize", src, "-o", tmp_path / "q") == "fresh maps for a 64 MiB block: 0"


def test_numpy_units_wait_for_the_pool_behind_a_slow_disk(tmp_path, monkeypatch):
    """A torch-free unit's own arrays count against the buffer pool's limit: behind a slow disk the
    writer and hashing queues (several units deep) must not fill with arrays the pool knows nothing
    of. With a limit of one byte each unit waits until the previous one is written and hashed, so
    besides the unit being handed over at most one more (whose arrays are being let go) is alive;
    without the accounting five or six were. Every loan is given back at the end."""
    import threading
    import time
    import weakref

    import numpy as np

    import mocli.io.shard_writer as shard_writer
    import mocli.stream.job as job_mod
    import mocli.stream.writer as writer_mod
    from mocli.checkpoint import open_checkpoint
    from mocli.convert import convert as convert_fn
    from mocli.stream.pool import BufferPool
    from mocli.targets import Target

    src = make_checkpoint(tmp_path / "src", algo="NVFP4", layers=8, hidden=256, intermediate=512)
    pools: list[BufferPool] = []

    class TinyPool(BufferPool):
        def __init__(self, pin: bool = False, limit: int | None = None) -> None:
            super().__init__(pin, limit=1)
            pools.append(self)

    real_write = shard_writer.ShardWriter.write

    def slow_write(self, *a, **k):
        time.sleep(0.02)
        return real_write(self, *a, **k)

    live = {"units": 0, "most": 0, "handed": 0}
    lock = threading.Lock()
    real_put = writer_mod.Writer.put

    def put(self, unit, pieces, borrowed):
        arrays = [p.data for p in pieces if isinstance(p.data, np.ndarray)]
        if arrays:
            left = [len(arrays)]

            def gone() -> None:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        live["units"] -= 1

            with lock:
                live["units"] += 1
                live["handed"] += 1
                live["most"] = max(live["most"], live["units"])
            for a in arrays:
                weakref.finalize(a, gone)
            del arrays
        return real_put(self, unit, pieces, borrowed)

    monkeypatch.setattr(job_mod, "BufferPool", TinyPool)
    monkeypatch.setattr(shard_writer.ShardWriter, "write", slow_write)
    monkeypatch.setattr(writer_mod.Writer, "put", put)
    convert_fn(open_checkpoint(src), tmp_path / "out", Target("flashinfer-trtllm"), device="cpu")
    assert live["handed"] >= 16  # enough units to fill the queues
    assert live["most"] <= 3, live
    assert pools and all(p.out == 0 for p in pools)


def test_the_manifest_says_which_engine_rules_it_was_written_for(cli, tmp_path):
    """``serving``: the vLLM releases, the KV-cache dtype --kv-cache-dtype auto gives the source's KV-cache
    algorithm there (vLLM's ModelOpt map), and that mocli's kernels run MoE layers (LAYOUT.md)."""
    out = tmp_path / "fp8kv"
    assert cli("convert", REAL_LLAMA, "-o", out, "-t", "flashinfer-cutlass").exit_code == 0
    serving = json.loads((out / "mocli-layout.json").read_text())["serving"]["vllm"]
    assert serving["releases"] == ["0.32", "0.33"] and serving["kv_cache_dtype"] == "fp8_e4m3"
    src = make_checkpoint(tmp_path / "nokv", kv_cache=False)
    assert cli("convert", src, "-o", tmp_path / "o2", "-t", "flashinfer-cutlass").exit_code == 0
    assert json.loads((tmp_path / "o2" / "mocli-layout.json").read_text())["serving"]["vllm"]["kv_cache_dtype"] == "auto"


def test_mocli_digest_chooses_what_is_recorded_and_any_record_is_read(tmp_path, cli):
    """``MOCLI_DIGEST=blake3`` records BLAKE3 digests of the outputs and the source shards (checked against
    the blake3 package itself), which a process at the default (XXH3-128) still verifies, and catches a
    damaged shard by; a name mocli does not know is a one-line usage error, with nothing written."""
    import blake3

    def run(out: Path, digest: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mocli", "-q", "convert", str(REAL_LLAMA), "-o", str(out),
                               "--target", "flashinfer-cutlass"], capture_output=True, text=True,
                              env={**os.environ, "MOCLI_DIGEST": digest})

    out = tmp_path / "o"
    p = run(out, "blake3")
    assert p.returncode == 0, p.stderr
    manifest = json.loads((out / "mocli-layout.json").read_text())
    assert all(info == {"size": (out / f).stat().st_size, "blake3": blake3.blake3((out / f).read_bytes()).hexdigest()}
               for f, info in manifest["files"].items())
    assert manifest["provenance"]["source_shards"] == {
        s.name: {"blake3": blake3.blake3(s.read_bytes()).hexdigest()} for s in sorted(REAL_LLAMA.glob("*.safetensors"))}
    assert cli("verify", out).exit_code == 0
    shard = next(out.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    r = cli("verify", out)
    assert r.exit_code == 1 and "blake3 digest differs" in r.stdout + r.stderr

    bad = run(tmp_path / "bad", "md5")
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert bad.stderr.count("\n") == 1 and "MOCLI_DIGEST='md5'" in bad.stderr and "xxh3_128" in bad.stderr
