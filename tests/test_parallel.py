"""convert --tp/--ep: every rank's tensors against the source sliced by a second implementation of
SEMANTICS §10 (tests/reference.py), then the tp = 1 transforms; refusals; torchrun byte-identity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from fixtures.generate import make_checkpoint
from mocli.loader import Fp8Linear, Nvfp4Linear, Nvfp4MoE, load_converted
from tests import reference as ref
from tests.conftest import PYTHONPATH, REAL, REAL_LLAMA, REAL_QWEN, digest_tree, interrupt_after

CUTLASS, TRTLLM = "flashinfer-cutlass", "flashinfer-trtllm"
FP8 = torch.float8_e4m3fn


def convert(cli, src, out, target, *extra):
    r = cli("--json", "convert", src, "-o", out, "--target", target, *extra)
    assert r.exit_code == 0, r.stderr
    return r.json


def rank_tensors(out: Path, rank: int) -> dict[str, torch.Tensor]:
    t = {}
    for f in sorted((out / f"rank-{rank}").glob("model-*.safetensors")):
        t |= load_file(str(f))
    return t


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1) if t.element_size() == 1 else t.contiguous().reshape(-1)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(u8(a), u8(b))


def requant(q, s, big):
    return q if s == big else ref.fp8_requant(q, s, big)


# --- dense ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [CUTLASS, TRTLLM])
def test_fp8_dense_gqa_with_fewer_kv_heads_than_ranks(cli, tmp_path, target):
    # 4 query heads, 1 kv head, tp 2: every rank holds all of k/v (replicated), half of q.
    src = make_checkpoint(tmp_path / "src", arch="llama", algo="FP8", heads=4, kv_heads=1, head_dim=32)
    out = tmp_path / "o"
    summary = convert(cli, src, out, target, "--tp", "2")
    assert summary["parallel"] == {"tp": 2, "ep": 1, "ranks": 2, "moe": "tensor-parallel"}
    s = load_file(str(src / "model.safetensors"))
    shared = load_file(str(next(out.glob("model-*.safetensors"))))
    assert "model.norm.weight" in shared and not any("qkv_proj" in k for k in shared)
    for r in range(2):
        got = rank_tensors(out, r)
        for layer in range(2):
            p = f"model.layers.{layer}."
            shards = [("q_proj", "q"), ("k_proj", "kv"), ("v_proj", "kv")]
            scales = [s[f"{p}self_attn.{x}.weight_scale"] for x, _ in shards]
            big = torch.stack(scales).max()
            want = torch.cat([requant(s[f"{p}self_attn.{x}.weight"], sc, big)[
                ref.head_rows(role, s[f"{p}self_attn.{x}.weight"].shape[0], 2, r, 1, 32)]
                for (x, role), sc in zip(shards, scales, strict=True)])
            assert same(got[f"{p}self_attn.qkv_proj.weight"], want)
            assert got[f"{p}self_attn.qkv_proj.weight_scale"] == big  # global scalars: identical on every rank
            # row-parallel o_proj / down_proj: columns
            for m in ("self_attn.o_proj", "mlp.down_proj"):
                w = s[f"{p}{m}.weight"]
                assert same(got[f"{p}{m}.weight"], w[:, ref.part(w.shape[1], 2, r)])
                assert got[f"{p}{m}.weight_scale"] == s[f"{p}{m}.weight_scale"]
            # column-parallel gate_up: rows of each shard
            gs, us = s[f"{p}mlp.gate_proj.weight_scale"], s[f"{p}mlp.up_proj.weight_scale"]
            big = torch.maximum(gs, us)
            g, u = requant(s[f"{p}mlp.gate_proj.weight"], gs, big), requant(s[f"{p}mlp.up_proj.weight"], us, big)
            assert same(got[f"{p}mlp.gate_up_proj.weight"], torch.cat([g[ref.part(256, 2, r)], u[ref.part(256, 2, r)]]))
    ck = load_converted(out, rank=1)
    qkv = ck.modules["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Fp8Linear) and (qkv.n, qkv.k) == (64 + 32 + 32, 128) and qkv.shard_rows == [64, 32, 32]


def test_nvfp4_dense_rank_k_needs_cutlass_padding(cli, tmp_path):
    # o_proj K = 2 heads x 48 = 96; at tp 2 a rank's K = 48, which cutlass pads to 64; q/k/v rank rows
    # 48 + 48 + 48 = 144 pad to 160. 16-element blocks: 48 / 16 = 3 block-scale columns per rank.
    src = make_checkpoint(tmp_path / "src", algo="NVFP4", heads=2, kv_heads=1, head_dim=48)
    out = tmp_path / "o"
    convert(cli, src, out, CUTLASS, "--tp", "2")
    s = load_file(str(src / "model.safetensors"))
    for r in range(2):
        got = rank_tensors(out, r)
        p = "model.layers.1.self_attn."
        w = s[p + "o_proj.weight"]  # [128, 48] packed
        bs = s[p + "o_proj.weight_scale"]  # [128, 6]
        assert same(got[p + "o_proj.weight"], ref.pad_bytes(w[:, ref.part(48, 2, r)], 128, 32))
        assert same(got[p + "o_proj.weight_scale"], ref.swizzle_by_offsets(bs[:, ref.part(6, 2, r)]))
        rows = [ref.head_rows("q", 96, 2, r, 1, 48), ref.head_rows("kv", 48, 2, r, 1, 48),
                ref.head_rows("kv", 48, 2, r, 1, 48)]
        ws = torch.cat([s[p + x + "_proj.weight"][sl] for x, sl in zip("qkv", rows, strict=True)])
        bss = torch.cat([s[p + x + "_proj.weight_scale"][sl] for x, sl in zip("qkv", rows, strict=True)])
        assert same(got[p + "qkv_proj.weight"], ref.pad_bytes(ws, 160, 64))
        assert same(got[p + "qkv_proj.weight_scale"], ref.swizzle_by_offsets(bss))
        a = max(float(s[p + x + "_proj.input_scale"]) for x in "qkv")
        assert float(got[p + "qkv_proj.input_scale"]) == a
    o = load_converted(out, rank=0).modules["model.layers.0.self_attn.o_proj"]
    assert isinstance(o, Nvfp4Linear) and (o.n, o.k, o.padded_n, o.padded_k) == (128, 48, 128, 64)


# --- MoE --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", [CUTLASS, TRTLLM])
def test_nvfp4_moe_tensor_parallel_on_i(cli, tmp_path, target):
    # 4 heads / 2 kv heads of 32: a rank's q|k|v rows are 64 + 32 + 32 = 128 (trtllm's tile)
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", moe_intermediate=256,
                          unify_scale_2=False, heads=4, kv_heads=2, head_dim=32)
    out = tmp_path / "o"
    convert(cli, src, out, target, "--tp", "2")
    s = load_file(str(src / "model.safetensors"))
    p, e_count, i = "model.layers.0.mlp.experts", 4, 256
    trt = target == TRTLLM
    a13 = max(float(s[f"{p}.{e}.{x}.input_scale"]) for e in range(e_count) for x in ("gate_proj", "up_proj"))
    for r in range(2):
        got = rank_tensors(out, r)
        rows = ref.part(i, 2, r)
        for e in range(e_count):
            sp = f"{p}.{e}."
            s1, s3 = float(s[sp + "gate_proj.weight_scale_2"]), float(s[sp + "up_proj.weight_scale_2"])
            big = max(s1, s3)

            def rescale(bs, x, big=big):
                return (bs.float() * x / big).clamp(-448, 448).to(FP8) if x != big else bs

            w13 = torch.cat([s[sp + "up_proj.weight"][rows], s[sp + "gate_proj.weight"][rows]])
            bs13 = torch.cat([rescale(s[sp + "up_proj.weight_scale"], s3)[rows],
                              rescale(s[sp + "gate_proj.weight_scale"], s1)[rows]])
            w2 = s[sp + "down_proj.weight"][:, ref.part(i // 2, 2, r)]
            bs2 = s[sp + "down_proj.weight_scale"][:, ref.part(i // 16, 2, r)]
            if trt:
                w13, bs13 = ref.shuffle_rows(ref.gated_reorder(w13)), ref.shuffle_rows(ref.gated_reorder(bs13))
                w2, bs2 = ref.shuffle_rows(w2), ref.shuffle_rows(bs2)
            assert same(got[p + ".w13_weight"][e], w13)
            assert same(got[p + ".w13_weight_scale"][e], ref.swizzle_by_offsets(bs13))
            assert same(got[p + ".w2_weight"][e], w2)
            assert same(got[p + ".w2_weight_scale"][e], ref.swizzle_by_offsets(bs2))
            assert float(got[p + ".w13_weight_scale_2"][e]) == big
        assert torch.allclose(got[p + ".a1_gscale"], torch.full((e_count,), 1 / a13))
    moe = load_converted(out, rank=1).modules[p]
    assert isinstance(moe, Nvfp4MoE) and (moe.experts, moe.intermediate, moe.hidden) == (4, 128, 128)


@pytest.mark.parametrize("target", [CUTLASS, TRTLLM])
def test_fp8_moe_expert_parallel(cli, tmp_path, target):
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8")
    out = tmp_path / "o"
    convert(cli, src, out, target, "--tp", "2", "--ep", "2")
    s = load_file(str(src / "model.safetensors"))
    p = "model.layers.1.block_sparse_moe.experts"
    a1 = max(float(s[f"{p}.{e}.{w}.input_scale"]) for e in range(4) for w in ("w1", "w3"))
    for r in range(2):
        got = rank_tensors(out, r)
        assert got[p + ".w13_weight"].shape == (2, 256, 128)
        for local, e in enumerate(range(2 * r, 2 * r + 2)):
            s1, s3 = s[f"{p}.{e}.w1.weight_scale"], s[f"{p}.{e}.w3.weight_scale"]
            big = torch.maximum(s1, s3)
            w13 = torch.cat([requant(s[f"{p}.{e}.w3.weight"], s3, big), requant(s[f"{p}.{e}.w1.weight"], s1, big)])
            w2 = s[f"{p}.{e}.w2.weight"]
            if target == TRTLLM:
                w13, w2 = ref.shuffle_rows(ref.gated_reorder(w13)), ref.shuffle_rows(w2)
            assert same(got[p + ".w13_weight"][local], w13) and same(got[p + ".w2_weight"][local], w2)
            assert got[p + ".w13_weight_scale"][local] == big
        # a1/a2: the max over all experts on every rank (SEMANTICS §10 mocli policy)
        assert float(got[p + ".w13_input_scale"]) == a1
    manifest = json.loads((out / "mocli-layout.json").read_text())
    assert [m["meta"]["expert_offset"] for rk in manifest["ranks"] for m in rk["modules"] if m["kind"] == "fp8_moe"] \
        == [0, 0, 2, 2]


def test_expert_parallel_ranks_equal_the_tp1_experts(cli, tmp_path):
    """SEMANTICS §10 property: each EP rank's per-expert tensors are experts [r E/ep, ...) of tp = 1."""
    one, ep = tmp_path / "one", tmp_path / "ep"
    convert(cli, REAL_QWEN, one, TRTLLM)
    convert(cli, REAL_QWEN, ep, TRTLLM, "--ep", "2")
    full = {}
    for f in one.glob("model-*.safetensors"):
        full |= load_file(str(f))
    p = "model.layers.1.mlp.experts"
    for r in range(2):
        got = rank_tensors(ep, r)
        for role in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale", "g1_alphas", "a1_gscale"):
            assert same(got[f"{p}.{role}"], full[f"{p}.{role}"][4 * r: 4 * r + 4]), role


# --- real exports and refusals ---------------------------------------------------------------------------

@pytest.mark.parametrize("target", [CUTLASS, TRTLLM])
@pytest.mark.parametrize("name,extra", [("llama-fp8_kv", ["--tp", "2"]), ("qwen3_moe-nvfp4_kv", ["--tp", "2"]),
                                        ("qwen3_moe-nvfp4_kv", ["--tp", "2", "--ep", "2"])])
def test_real_exports_convert_per_rank(cli, tmp_path, target, name, extra):
    out = tmp_path / "o"
    convert(cli, REAL / name, out, target, *extra)
    manifest = json.loads((out / "mocli-layout.json").read_text())
    assert len(manifest["ranks"]) == 2 and manifest["parallel"]["tp"] == 2
    for rk in manifest["ranks"]:
        assert (out / rk["dir"] / "model.safetensors.index.json").exists() and rk["modules"]
    # every file the manifest lists is there with its recorded BLAKE3 digest
    for rel, info in manifest["files"].items():
        assert xxhash.xxh3_128((out / rel).read_bytes()).hexdigest() == info["xxh3_128"]


@pytest.mark.parametrize("src,args,code", [
    ("qwen", ["--tp", "4", "--target", CUTLASS], "TGT001"),  # I / tp = 32: 2I per rank = 64, not 128
    ("qwen", ["--ep", "3"], "PAR002"),  # 8 experts over 3 ranks
    ("llama", ["--tp", "8"], "PAR001"),  # 4 heads over 8 ranks
    ("llama", ["--tp", "2", "--ep", "3"], "PAR002"),  # ep is not tp x dp
])
def test_impossible_layouts_are_refused_with_their_finding(cli, tmp_path, src, args, code):
    path = REAL_QWEN if src == "qwen" else REAL_LLAMA
    r = cli("--json", "validate", path, *args)
    assert r.exit_code == 1 and code in [f["code"] for f in r.json["findings"]]
    target = args[args.index("--target") + 1] if "--target" in args else TRTLLM
    extra = [a for a in args if a not in ("--target", CUTLASS)]
    r = cli("convert", path, "-o", tmp_path / "o", "--target", target, *extra)
    assert r.exit_code == 1 and code in r.stderr and not (tmp_path / "o").exists()


def test_loader_needs_a_rank_for_a_multi_rank_output(cli, tmp_path):
    convert(cli, REAL_LLAMA, tmp_path / "o", CUTLASS, "--tp", "2")
    from mocli.errors import InputError

    with pytest.raises(InputError, match="2 ranks"):
        load_converted(tmp_path / "o")
    r = cli("verify", tmp_path / "o", "--rank", "5")
    assert r.exit_code == 2 and "rank" in r.stderr


# --- torchrun ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    """A port nothing listens on now, per run. Every torchrun of a test session used to share one fixed
    port, which a previous run's store may still hold: the suspected cause of one failure of
    test_torchrun_resumes_a_single_process_partial in a full run (not reproduced in 8 more runs)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(_free_port()), "-m", "mocli", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_torchrun_two_processes_match_one(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", shards=2, heads=4, kv_heads=2,
                          head_dim=32, moe_intermediate=256)
    convert(cli, src, tmp_path / "one", TRTLLM, "--tp", "2")
    p = _torchrun(2, "-q", "convert", str(src), "-o", str(tmp_path / "two"), "--target", TRTLLM, "--tp", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert digest_tree(tmp_path / "one") == digest_tree(tmp_path / "two")
    assert not list(tmp_path.glob(".two.mocli-*"))


@pytest.mark.slow
def test_torchrun_resumes_a_single_process_partial(cli, tmp_path, monkeypatch):
    """A partial from an interrupted one-process run is finished by a torchrun run, byte-identically."""
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="FP8", experts=8)
    convert(cli, src, tmp_path / "clean", CUTLASS, "--tp", "2")
    interrupt_after(monkeypatch, 12)
    r = cli("convert", src, "-o", tmp_path / "o", "--target", CUTLASS, "--tp", "2")
    assert r.exit_code == 130 and "resume" in r.stderr
    monkeypatch.undo()
    p = _torchrun(2, "--json", "convert", str(src), "-o", str(tmp_path / "o"), "--target", CUTLASS, "--tp", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["resumed_units"] > 0
    assert digest_tree(tmp_path / "o") == digest_tree(tmp_path / "clean")
    shutil.rmtree(tmp_path / "o")


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_qkv_biases_are_sliced_with_their_rows_and_verified(cli, tmp_path, algo):
    src = make_checkpoint(tmp_path / "src", algo=algo, qkv_bias=True, heads=4, kv_heads=2, head_dim=32)
    s = load_file(str(src / "model.safetensors"))
    for extra in ([], ["--tp", "2"]):
        out = tmp_path / f"o{len(extra)}"
        convert(cli, src, out, CUTLASS, *extra)
        r = cli("--json", "verify", out)
        assert r.exit_code == 0, [m["message"] for m in r.json["modules"] if not m["passed"]]
        p = "model.layers.0.self_attn."
        for rank in (range(2) if extra else [None]):
            got = rank_tensors(out, rank) if rank is not None else load_file(str(next(out.glob("model-*.safetensors"))))
            t = 0 if rank is None else rank
            tp = 2 if extra else 1
            want = torch.cat([s[p + "q_proj.bias"][ref.head_rows("q", 128, tp, t, 2, 32)],
                              s[p + "k_proj.bias"][ref.head_rows("kv", 64, tp, t, 2, 32)],
                              s[p + "v_proj.bias"][ref.head_rows("kv", 64, tp, t, 2, 32)]])
            assert same(got[p + "qkv_proj.bias"], want)
    # a bias off by a little is caught by verify
    f = next((tmp_path / "o2" / "rank-1").glob("model-*.safetensors"))
    t = load_file(str(f))
    t["model.layers.1.self_attn.qkv_proj.bias"] = t["model.layers.1.self_attn.qkv_proj.bias"] + 0.5
    from safetensors.torch import save_file

    save_file(t, str(f), metadata={"format": "pt"})
    r = cli("--json", "verify", tmp_path / "o2")
    bad = [(m["module"], m["rank"]) for m in r.json["modules"] if not m["passed"]]
    assert r.exit_code == 1 and bad == [("model.layers.1.self_attn.qkv_proj", 1)]
