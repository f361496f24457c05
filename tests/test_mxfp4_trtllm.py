"""convert --target flashinfer-trtllm for MXFP4 experts (SEMANTICS §19.3, §19.6; issue 46 items 3-5): every real
MXFP4 MoE spelling per rank (tp 1, tp 2, tp 2 ep 2) against tests/reference.py's step-by-step restatement of
vLLM 0.33 / FlashInfer (the source read with the safetensors library); validate agreeing with convert; TGT002 for
dense MXFP4 (naming marlin) and for flashinfer-cutlass (naming flashinfer-trtllm); verify passing and catching
planted faults; the serving kernel against an MoE computed here from the source's dequantized weights.

The fixtures other than gpt-oss's native export quantize their attention too; flashinfer-trtllm takes no MXFP4
linear, so those are derived here with every dense MXFP4 linear dequantized to BF16 (this file's own decode) and
listed in the config's ignore/exclude list: their experts are the real export's bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REAL, edit_tensor, load_tensors
from tests.reference import dequant_mxfp4, trtllm_mxfp4_rank

NATIVE = "gpt_oss-mxfp4"
DERIVED = ("gpt_oss-quark-mxfp4", "gpt_oss-ct-mxfp4a16", "qwen3_moe-ct-mxfp4", "qwen3_moe-quark-mxfp4")
PARALLEL = (("1", "1"), ("2", "1"), ("2", "2"))
TARGET = "flashinfer-trtllm"


def experts_only(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with every non-expert MXFP4 linear dequantized to BF16 and excluded in the config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    q, dense = cfg["quantization_config"], []
    for f in sorted(dst.glob("*.safetensors")):
        t = load_file(str(f))
        for name in [n for n in t if n.endswith((".weight_packed", ".weight")) and ".experts." not in n]:
            module = name.rsplit(".", 1)[0]
            scale = t.get(f"{module}.weight_scale")
            if scale is None or t[name].dtype != torch.uint8:
                continue
            packed = t.pop(name)
            del t[f"{module}.weight_scale"]
            t[f"{module}.weight"] = dequant_mxfp4(packed, scale).bfloat16()
            dense.append(module)
        save_file(t, str(f), metadata={"format": "pt"})
    key = "exclude" if q.get("quant_method") == "quark" else "ignore"
    q[key] = list(q.get(key) or []) + dense
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    index = dst / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {n: f.name for f in dst.glob("*.safetensors") for n in load_file(str(f))}
        index.write_text(json.dumps(idx))
    return dst


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mxfp4")
    return {NATIVE: REAL / NATIVE} | {n: experts_only(REAL / n, base / n) for n in DERIVED}


def _source_experts(src: Path, layer: str, e: int) -> tuple:
    """(w13, s13, b13, w2, s2, b2, interleaved) of one expert, read with safetensors: w13 interleaved (gate_i, up_i)
    for gpt-oss's fused tensors, else [gate; up]."""
    t = load_tensors(src)
    if f"{layer}.gate_up_proj_blocks" in t:  # gpt-oss native [E, N, K/32, 16]
        g = lambda n: t[f"{layer}.{n}"][e]  # noqa: E731
        return (g("gate_up_proj_blocks").reshape(g("gate_up_proj_blocks").shape[0], -1), g("gate_up_proj_scales"),
                g("gate_up_proj_bias"), g("down_proj_blocks").reshape(g("down_proj_blocks").shape[0], -1),
                g("down_proj_scales"), g("down_proj_bias"), True)
    p = f"{layer}.{e}"
    w = lambda m: t.get(f"{p}.{m}.weight_packed", t.get(f"{p}.{m}.weight"))  # noqa: E731
    if f"{p}.gate_up_proj.weight" in t:  # Quark gpt-oss: fused, interleaved
        return (w("gate_up_proj"), t[f"{p}.gate_up_proj.weight_scale"], t.get(f"{p}.gate_up_proj.bias"), w("down_proj"),
                t[f"{p}.down_proj.weight_scale"], t.get(f"{p}.down_proj.bias"), True)
    cat = lambda s: None if f"{p}.gate_proj.{s}" not in t else torch.cat([t[f"{p}.gate_proj.{s}"], t[f"{p}.up_proj.{s}"]])  # noqa: E731
    return (torch.cat([w("gate_proj"), w("up_proj")]), cat("weight_scale"), cat("bias"), w("down_proj"),
            t[f"{p}.down_proj.weight_scale"], t.get(f"{p}.down_proj.bias"), False)


def _rank_rows(i: int, tp: int, ep: int, r: int, interleaved: bool) -> tuple[int, int]:
    if ep > 1 or tp == 1:
        return 0, i
    if interleaved:  # gpt-oss loaders: whole 32-blocks, P = 32 ceil(I / (32 tp))
        p = 32 * -(-i // (32 * tp))
        return min(r * p, i), min((r + 1) * p, i)
    return r * i // tp, (r + 1) * i // tp


# gpt-oss's loaders at tp 16 (I = 256): P = 32, so ranks 0-7 hold 32 rows each and ranks 8-15 none (§19.3)
UNEVEN = [(n, "16", "1") for n in (NATIVE, "gpt_oss-quark-mxfp4")]


@pytest.mark.parametrize("name,tp,ep", [(n, tp, ep) for n in (NATIVE, *DERIVED) for tp, ep in PARALLEL] + UNEVEN)
def test_bytes_per_rank_match_the_reference(inputs, cli, tmp_path, name, tp, ep):
    src, out = inputs[name], tmp_path / "out"
    assert cli("validate", src, "--target", TARGET, "--tp", tp, "--ep", ep).exit_code == 0
    r = cli("convert", src, "-o", out, "--target", TARGET, "--tp", tp, "--ep", ep)
    assert r.exit_code == 0, r.stderr
    tp, ep = int(tp), int(ep)
    ranks = max(tp, ep)
    manifest = json.loads((out / "mocli-layout.json").read_text())
    cfg = json.loads((src / "config.json").read_text())
    e_total, h = cfg["num_local_experts"], cfg["hidden_size"]
    pad = 1 if "quark" in name else 0
    for rank in range(ranks):
        got = load_tensors(out / f"rank-{rank}" if ranks > 1 else out)
        for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
            e0, e1 = (rank * e_total // ep, (rank + 1) * e_total // ep) if ep > 1 else (0, e_total)
            for e in range(e0, e1):
                w13, s13, b13, w2, s2, b2, inter = _source_experts(src, layer, e)
                i = w13.shape[0] // 2
                i0, i1 = _rank_rows(i, tp, ep, rank, inter)
                ip = -(-(i if ep > 1 else i // tp) // 128) * 128
                want = trtllm_mxfp4_rank(w13, s13, b13, w2, s2, b2, inter, i0, i1, ip, -(-h // 256) * 256, pad,
                                         rank0=ep > 1 or rank == 0)
                for role, value in want.items():
                    stored = got[f"{layer}.{role}"][e - e0]
                    assert torch.equal(stored.reshape(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8)), \
                        (name, rank, layer, e, role)
                assert (b13 is not None) == (f"{layer}.w13_bias" in got)
    mods = [m for m in manifest["modules"] if m["kind"] == "mxfp4_moe"] if manifest["modules"] else []
    for rank_info in manifest.get("ranks") or []:
        mods += [m for m in rank_info.get("modules", []) if m["kind"] == "mxfp4_moe"]
    assert mods, manifest.keys()
    for m in mods:
        assert m["meta"]["activation_dtype"] == "bf16"
        assert m["meta"]["activation"] == ("swigluoai" if name.startswith("gpt_oss") else "silu")
        assert ("vllm_path" in m["meta"]) == (not m["meta"]["gate_up"] == "interleaved")


@pytest.mark.parametrize("name", DERIVED[2:])
def test_dense_mxfp4_refused_naming_marlin(cli, tmp_path, name):
    r = cli("validate", REAL / name, "--target", TARGET)
    assert r.exit_code != 0 and "TGT002" in r.stdout and "--target marlin" in r.stdout
    r = cli("convert", REAL / name, "-o", tmp_path / "out", "--target", TARGET)
    assert r.exit_code in (1, 2) and "TGT002" in r.stdout + r.stderr and not (tmp_path / "out").exists()


def test_cutlass_refuses_mxfp4_experts_naming_trtllm(cli):
    r = cli("validate", REAL / NATIVE, "--target", "flashinfer-cutlass")
    assert r.exit_code != 0 and "TGT002" in r.stdout and "--target flashinfer-trtllm" in r.stdout


@pytest.mark.parametrize("name,tp,ep", ((NATIVE, "2", "1"), ("gpt_oss-quark-mxfp4", "1", "1"),
                                        ("qwen3_moe-ct-mxfp4", "2", "1"), ("gpt_oss-ct-mxfp4a16", "2", "2")))
def test_verify_passes_and_catches_planted_faults(inputs, cli, tmp_path, name, tp, ep):
    out = tmp_path / "out"
    assert cli("convert", inputs[name], "-o", out, "--target", TARGET, "--tp", tp, "--ep", ep).exit_code == 0
    r = cli("verify", out)
    assert r.exit_code == 0, r.stdout + r.stderr
    layer, ranks = "model.layers.0.mlp.experts", max(int(tp), int(ep))
    faults = {
        "w13 weight byte": (f"{layer}.w13_weight", lambda t: _poke(t, (0, 0, 0), 0x11)),
        "w2 scale byte": (f"{layer}.w2_weight_scale", lambda t: _poke(t, (0, 0, 0), 0x05)),
        # the last stored scale byte: padding where Ip > the rank's I (qwen3 at tp 2), else a real scale
        "w13 scale padding": (f"{layer}.w13_weight_scale", lambda t: _poke(t, (0, -1, -1), 0x7F)),
    }
    if name.startswith("gpt_oss"):
        faults["w13 bias"] = (f"{layer}.w13_bias", lambda t: _poke(t, (0, 0), 3.0))
    for what, (tensor, fn) in faults.items():
        bad = tmp_path / what.replace(" ", "_")
        shutil.copytree(out, bad)
        edit_tensor(bad / ("rank-0" if ranks > 1 else ""), tensor, fn)
        r = cli("verify", bad, "--json")
        assert r.exit_code != 0, (what, r.stdout)
        # the layer's own check, not only the file digest (which any changed byte breaks)
        assert any(m["module"] == layer and not m["passed"] for m in json.loads(r.stdout)["modules"]), (what, r.stdout)
    if name.startswith("gpt_oss") and int(tp) > 1 and int(ep) == 1:  # down bias on rank 1: must be zeros
        bad = tmp_path / "b2"
        shutil.copytree(out, bad)
        edit_tensor(bad / "rank-1", f"{layer}.w2_bias", lambda t: _poke(t, (0, 0), 1.0))
        assert cli("verify", bad).exit_code != 0


def test_verify_without_the_weight_views(inputs, cli, tmp_path, monkeypatch):
    """verify reads an expert's weight as views of the stored bytes where its kept rows fill whole row groups
    (every fixture here); other sizes take the copying path, forced here: it passes and catches a weight byte."""
    from mocli.verify.kinds import mxfp4_moe

    out, layer = tmp_path / "out", "model.layers.0.mlp.experts"
    assert cli("convert", inputs["qwen3_moe-ct-mxfp4"], "-o", out, "--target", TARGET, "--tp", "2").exit_code == 0
    monkeypatch.setattr(mxfp4_moe, "weight_views", lambda *a: None)
    assert cli("verify", out).exit_code == 0
    for tensor, at in (("w13_weight", (0, 0, 0)), ("w13_weight", (0, -1, -1)), ("w2_weight", (-1, -1, -1))):
        bad = tmp_path / f"{tensor}{at[-1]}"
        shutil.copytree(out, bad)
        edit_tensor(bad / "rank-0", f"{layer}.{tensor}", lambda t, at=at: _poke(t, at, 0x11))
        r = cli("verify", bad, "--json")
        assert any(m["module"] == layer and not m["passed"] for m in json.loads(r.stdout)["modules"]), (tensor, at)


def _poke(t: torch.Tensor, at: tuple, value) -> torch.Tensor:
    if t.dtype == torch.uint8:
        t[at] = int(t[at]) ^ value
    else:
        t[at] = t[at] + value
    return t


@pytest.mark.parametrize("name,tp", ((NATIVE, 2), ("qwen3_moe-quark-mxfp4", 1), ("gpt_oss-ct-mxfp4a16", 1)))
def test_serving_kernel_matches_an_independent_moe(inputs, cli, tmp_path, name, tp):
    """Every rank's kernel, summed, against the source's experts dequantized here and run with vLLM's activation
    (SwigluOAI for gpt-oss, SiLU otherwise), BF16 input."""
    from mocli.loader import open_converted
    from mocli.serve import kernel_of

    out = tmp_path / "out"
    assert cli("convert", inputs[name], "-o", out, "--target", TARGET, "--tp", str(tp)).exit_code == 0
    layer, cfg = "model.layers.1.mlp.experts", json.loads((inputs[name] / "config.json").read_text())
    e_total, h, k = cfg["num_local_experts"], cfg["hidden_size"], 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(16)])
    wts = torch.rand(16, k, generator=g)
    got = torch.zeros(16, h)
    for rank in range(tp):
        ck = open_converted(out, rank=rank) if tp > 1 else open_converted(out)
        got += kernel_of(ck, layer)(x, wts, ids).float()
    want = torch.zeros(16, h)
    for t in range(16):
        for j in range(k):
            w13, s13, b13, w2, s2, b2, inter = _source_experts(inputs[name], layer, int(ids[t, j]))
            f13, f2 = dequant_mxfp4(w13, s13), dequant_mxfp4(w2, s2)
            o1 = x[t].float() @ f13.T + (b13.float() if b13 is not None else 0)
            if inter:
                gate, up = o1[0::2], o1[1::2]
            else:
                gate, up = o1[:o1.shape[0] // 2], o1[o1.shape[0] // 2:]
            if name.startswith("gpt_oss"):
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            else:
                act = torch.nn.functional.silu(gate) * up
            y = act.bfloat16().float() @ f2.T + (b2.float() if b2 is not None else 0)
            want[t] += wts[t, j] * y
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, float(err)
