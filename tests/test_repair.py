"""repair (SEMANTICS §11): every repairable finding fixed in the ModelOpt format, checked against an
independent dequantization; unrepairable ones refused with nothing written; convert agrees."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
import xxhash

from fixtures.generate import (
    BROKEN,
    _both_exclude,
    _edit_tensors,
    make_broken,
    make_checkpoint,
)
from tests import reference as ref
from tests.conftest import REAL, interrupt_after, load_tensors, u8


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(u8(a), u8(b))


def repaired(cli, src, out, *extra):
    r = cli("--json", "repair", src, "-o", out, *extra)
    assert r.exit_code == 0, r.stderr
    return r.json


# Repairable variants, each with the codes it shows before and must not show after.
def _excluded_but_quantized(d):  # EXC003 alone: listing a quantized module
    _both_exclude(lambda ex: ex.append("model.layers.0.self_attn.o_proj"))(d)


def _partial_exclusion_consistent_storage(d):  # EXC002 with every shard stored quantized
    _both_exclude(lambda ex: ex.append("model.layers.0.self_attn.q_proj"))(d)


VARIANTS = {
    "SCL005": (dict(arch="qwen3_moe", algo="NVFP4", unify_scale_2=False), None),
    "SCL003": (BROKEN["SCL003"][0], BROKEN["SCL003"][1]),
    "EXC001": (BROKEN["EXC001"][0], BROKEN["EXC001"][1]),
    "EXC002": (dict(), _partial_exclusion_consistent_storage),
    "EXC003": (dict(), _excluded_but_quantized),
    "EXC004": (BROKEN["EXC004"][0], BROKEN["EXC004"][1]),
    "EXC005": (BROKEN["EXC005"][0], BROKEN["EXC005"][1]),
    "EXC006": (BROKEN["EXC006"][0], BROKEN["EXC006"][1]),
    "CFG001": (BROKEN["CFG001"][0], BROKEN["CFG001"][1]),
    "CFG002": (BROKEN["CFG002"][0], BROKEN["CFG002"][1]),
    "CFG003": (BROKEN["CFG003"][0], BROKEN["CFG003"][1]),
    "CFG004": (BROKEN["CFG004"][0], BROKEN["CFG004"][1]),
    "CFG006": (BROKEN["CFG006"][0], BROKEN["CFG006"][1]),
    "TNS004": (BROKEN["TNS004"][0], BROKEN["TNS004"][1]),
    "TNS005": (BROKEN["TNS005"][0], BROKEN["TNS005"][1]),
}


@pytest.mark.parametrize("code", sorted(VARIANTS))
def test_repairable_finding_validates_clean_after_repair(cli, tmp_path, code):
    kw, mutate = VARIANTS[code]
    src = make_checkpoint(tmp_path / "src", **kw)
    if mutate is not None:
        mutate(src)
    before = cli("--json", "validate", src).json
    assert code in {f["code"] for f in before["findings"]}, before["findings"]
    src_hash = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()}
    summary = repaired(cli, src, tmp_path / "out")
    assert summary["repairs"] and not summary["refused"]
    after = cli("--json", "validate", tmp_path / "out").json
    assert after["ok"] and not {f["code"] for f in after["findings"]} & {code}, after["findings"]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()} == src_hash  # input untouched
    # every tensor that no repair touched is the source's bytes; the others are listed in the plan
    touched = {r["location"] for r in summary["repairs"]}
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    for name, t in o.items():
        if name in s and not any(name.startswith(loc + ".") or name == loc for loc in touched):
            assert same(t, s[name]), name
    # both config files agree and carry the provenance
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text()) if (tmp_path / "out" / "hf_quant_config.json").exists() else None
    cj = json.loads((tmp_path / "out" / "config.json").read_text())
    if hq is not None and "quantization_config" in cj:
        assert sorted(hq["quantization"]["exclude_modules"]) == sorted(cj["quantization_config"]["ignore"])
        assert hq["mocli_repair"]["repairs"] == summary["repairs"] == cj["quantization_config"]["mocli_repair"]["repairs"]
    # and convert takes the output
    r = cli("convert", tmp_path / "out", "-o", tmp_path / "conv", "--target", "flashinfer-cutlass")
    assert r.exit_code in (0, 1), r.stderr
    if r.exit_code == 1:  # only a target constraint may refuse, never a repaired finding
        assert code not in r.stderr


def test_scale_2_repair_dequantizes_within_one_fp8_rounding(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", unify_scale_2=False)
    repaired(cli, src, tmp_path / "out")
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    groups = [[f"model.layers.{i}.self_attn.{x}_proj" for x in "qkv"] for i in range(2)]
    groups += [[f"model.layers.{i}.mlp.experts.{e}.{x}" for x in ("gate_proj", "up_proj")] for i in range(2) for e in range(4)]
    rescaled = 0
    for mods in groups:
        big = max(float(s[m + ".weight_scale_2"]) for m in mods)
        for m in mods:
            assert float(o[m + ".weight_scale_2"]) == big
            assert same(o[m + ".weight"], s[m + ".weight"])  # weights are never touched
            want = ref.dequant_nvfp4(s[m + ".weight"], s[m + ".weight_scale"], float(s[m + ".weight_scale_2"]))
            got = ref.dequant_nvfp4(o[m + ".weight"], o[m + ".weight_scale"], big)
            if float(s[m + ".weight_scale_2"]) == big:
                assert same(o[m + ".weight_scale"], s[m + ".weight_scale"])
            else:
                rescaled += 1
                # one e4m3 rounding of the rescaled block scale: at most half a step, 2^-4 relative
                assert torch.allclose(got, want, rtol=2.0**-4, atol=0), m
    assert rescaled > 0


def test_missing_expert_input_scale_gets_the_layers_max(cli, tmp_path):
    path, _ = make_broken("SCL003", tmp_path / "src")  # expert 2's w2 has no input_scale
    repaired(cli, path, tmp_path / "out")
    s, o = load_tensors(path), load_tensors(tmp_path / "out")
    p = "model.layers.1.block_sparse_moe.experts"
    others = [float(s[f"{p}.{e}.w2.input_scale"]) for e in range(4) if e != 2]
    assert float(o[f"{p}.2.w2.input_scale"]) == max(others) and o[f"{p}.2.w2.input_scale"].dtype == torch.float32
    assert set(o) == set(s) | {f"{p}.2.w2.input_scale"}


@pytest.mark.parametrize("code", ["SCL001", "SCL002", "DAT001", "TNS001", "TNS006"])
def test_unrepairable_findings_refuse_and_write_nothing(cli, tmp_path, code):
    path, _ = make_broken(code, tmp_path / "src")
    r = cli("--json", "repair", path, "-o", tmp_path / "out")
    assert r.exit_code == 1 and code in r.stderr and "nothing was written" in r.stderr
    assert [f["code"] for f in r.json["refused"]][:1] == [code] or code in [f["code"] for f in r.json["refused"]]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.mocli-*"))


def _drop_input_scales(container, proj=""):
    def mutate(d):
        _edit_tensors(d, lambda t: [t.pop(k) for k in list(t) if container in k and k.endswith(proj + ".input_scale")])
    return mutate


def _set(name, value):
    return lambda d: _edit_tensors(d, lambda t: t.__setitem__(name, value))


_MOE_FP8 = dict(arch="mixtral", algo="FP8")
_MOE_NVFP4 = dict(arch="qwen3_moe", algo="NVFP4", unify_scale_2=False)
_X = "model.layers.0.mlp.experts.0.gate_proj"
# SEMANTICS §11.5 and §11.2: what no repair fixes, each with the code that must name it.
NEVER_REPAIRED = {
    "no expert of a layer has input scales (FP8)": (_MOE_FP8, _drop_input_scales("layers.1.block_sparse_moe"),
                                                    "SCL003"),
    "no expert of a layer has input scales (NVFP4)": (_MOE_NVFP4, _drop_input_scales("layers.0.mlp.experts"),
                                                      "SCL003"),
    "no expert of a layer has a down input scale": (_MOE_FP8, _drop_input_scales("layers.1.block_sparse_moe", "w2"),
                                                    "SCL003"),
    "NaN expert input scale": (_MOE_FP8, _set("model.layers.1.block_sparse_moe.experts.0.w1.input_scale",
                                              torch.tensor(float("nan"))), "SCL001"),
    "NaN weight_scale_2 among mismatched ones": (_MOE_NVFP4, _set(_X + ".weight_scale_2", torch.tensor(float("nan"))),
                                                 "SCL001"),
    "zero weight_scale_2 among mismatched ones": (_MOE_NVFP4, _set(_X + ".weight_scale_2", torch.tensor(0.0)),
                                                  "SCL002"),
    "expert weight missing": (_MOE_FP8, lambda d: _edit_tensors(d, lambda t: t.pop(
        "model.layers.1.block_sparse_moe.experts.0.w1.weight")), "TNS001"),
    "dense weight missing, its scales kept": (dict(), lambda d: _edit_tensors(d, lambda t: t.pop(
        "model.layers.0.self_attn.o_proj.weight")), "TNS001"),
    "expert stored in float32": (_MOE_FP8, lambda d: _edit_tensors(d, lambda t: t.__setitem__(
        "model.layers.1.block_sparse_moe.experts.0.w2.weight",
        t["model.layers.1.block_sparse_moe.experts.0.w2.weight"].float())), "TNS006"),
    "weight_scale_2 of the wrong shape": (_MOE_NVFP4, _set(_X + ".weight_scale_2", torch.tensor([1.0, 2.0])), "TNS003"),
    "input_scale of the wrong shape": (_MOE_NVFP4, _set(_X + ".input_scale", torch.tensor([1.0, 2.0])), "TNS003"),
    "scale of the wrong dtype": (dict(), _set("model.layers.0.self_attn.o_proj.weight_scale",
                                              torch.tensor(0.01, dtype=torch.float16)), "TNS002"),
}


@pytest.mark.parametrize("case", sorted(NEVER_REPAIRED))
def test_never_repaired_paths_refuse_with_their_finding_and_write_nothing(cli, tmp_path, case):
    kw, mutate, code = NEVER_REPAIRED[case]
    src = make_checkpoint(tmp_path / "src", **kw)
    mutate(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    r = cli("--json", "repair", src, "-o", tmp_path / "out")
    assert r.exit_code == 1, r.stderr
    assert f"first: {code}" in r.stderr and "nothing was written" in r.stderr, r.stderr
    assert code in [f["code"] for f in r.json["refused"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no partial, no lock
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_mixed_storage_of_a_fused_group_is_refused(cli, tmp_path):
    path, _ = make_broken("EXC002", tmp_path / "src")  # q_proj stored BF16, k/v quantized: needs new weights
    r = cli("repair", path, "-o", tmp_path / "out")
    assert r.exit_code == 1 and "EXC002" in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["llama-fp8_kv", "qwen3_moe-nvfp4_kv"])
def test_real_exports_have_nothing_to_do(cli, tmp_path, name):
    summary = repaired(cli, REAL / name, tmp_path / "out")
    assert summary["nothing_to_do"] and summary["repairs"] == []
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (REAL / name / "model.safetensors").read_bytes()
    st = (tmp_path / "out" / "model.safetensors").stat()
    assert st.st_nlink == 1 and st.st_ino != (REAL / name / "model.safetensors").stat().st_ino  # a copy, not a link


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
def test_repair_then_convert_equals_convert_with_its_own_repairs(cli, tmp_path, target):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", unify_scale_2=False)
    repaired(cli, src, tmp_path / "fixed")
    for s, o in ((src, "a"), (tmp_path / "fixed", "b")):
        assert cli("-q", "convert", s, "-o", tmp_path / o, "--target", target).exit_code == 0
    a, b = load_tensors(tmp_path / "a"), load_tensors(tmp_path / "b")
    assert set(a) == set(b) and all(same(a[k], b[k]) for k in a)


def test_dry_run_writes_nothing_and_plans_in_json(cli, tmp_path):
    path, _ = make_broken("SCL005", tmp_path / "src")
    r = cli("--json", "repair", path, "--dry-run")
    assert r.exit_code == 0 and r.json["output"] is None
    assert {x["code"] for x in r.json["repairs"]} == {"SCL005"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    r = cli("repair", path, "--dry-run")
    assert "dry run" in r.stdout and "SCL005" in r.stdout


def test_sharded_hub_checkpoint_and_resume(cli, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", unify_scale_2=False, shards=3)
    repo = cache / "models--org--m"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / rev).mkdir(parents=True)
    for f in src.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", repo / "snapshots" / rev / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    env = {"HF_HUB_OFFLINE": "1"}
    restore = interrupt_after(monkeypatch, 60, "copy")  # most repaired-checkpoint bytes are verbatim copies
    r = cli("repair", "org/m", "-o", tmp_path / "out", env=env)
    assert r.exit_code == 130 and "resume" in r.stderr
    restore()
    r = cli("--json", "repair", "org/m", "-o", tmp_path / "out", env=env)
    assert r.exit_code == 0 and r.json["resumed_units"] > 0
    assert repaired(cli, src, tmp_path / "clean")
    a, b = load_tensors(tmp_path / "out"), load_tensors(tmp_path / "clean")
    assert set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in src.glob("*.safetensors")}


def _redigest(out):
    """Rewrite the provenance's output digests, as an attacker who edits a repaired file would."""
    for name in ("config.json", "hf_quant_config.json"):
        path = out / name
        data = json.loads(path.read_text())
        block = data["quantization_config"] if name == "config.json" else data
        block["mocli_repair"]["output_shards"] = {p.name: {"xxh3_128": xxhash.xxh3_128(p.read_bytes()).hexdigest()}
                                                  for p in sorted(out.glob("*.safetensors"))}
        path.write_text(json.dumps(data))


@pytest.mark.parametrize("code", ["SCL005", "SCL003", "TNS004", "EXC003"])
def test_verify_proves_a_repair_output(cli, tmp_path, code):
    kw, mutate = VARIANTS[code]
    src = make_checkpoint(tmp_path / "src", **kw)
    if mutate is not None:
        mutate(src)
    repaired(cli, src, tmp_path / "out")
    r = cli("--json", "verify", tmp_path / "out")
    assert r.exit_code == 0, (r.json["modules"], r.json["passthrough"], r.json["files"])
    kinds = {m["kind"] for m in r.json["modules"]}
    assert kinds == ({f"repair {code}"} if code in ("SCL005", "SCL003") else set())


def _fault(kind):
    def apply(t):
        if kind == "block scale byte":
            name = next(n for n in sorted(t) if n.endswith("k_proj.weight_scale"))
            t[name].view(torch.uint8).reshape(-1)[3] ^= 0x01
        elif kind == "scale_2 not the max":
            name = next(n for n in sorted(t) if n.endswith("k_proj.weight_scale_2"))
            t[name] = t[name] * 0.5
        elif kind == "unchanged tensor changed":
            t["model.norm.weight"] = t["model.norm.weight"] * 2
    return apply


@pytest.mark.parametrize("kind", ["block scale byte", "scale_2 not the max", "unchanged tensor changed",
                                  "tensor removed"])
def test_verify_catches_faults_in_a_repair_output(cli, tmp_path, kind):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", unify_scale_2=False)
    out = tmp_path / "out"
    repaired(cli, src, out)
    shard = out / "model.safetensors"
    t = load_tensors(out)
    if kind == "tensor removed":
        del t["lm_head.weight"]
    else:
        _fault(kind)(t)
    from safetensors.torch import save_file

    save_file(t, str(shard), metadata={"format": "pt"})
    _redigest(out)
    r = cli("--json", "verify", out)
    assert r.exit_code == 1
    bad = [m["module"] for m in r.json["modules"] if not m["passed"]] + [p["tensor"] for p in r.json["passthrough"]["problems"]]
    assert bad, r.json


def test_repairing_a_repaired_checkpoint_records_its_own_provenance(cli, tmp_path):
    src, _ = make_broken("SCL005", tmp_path / "src")
    repaired(cli, src, tmp_path / "once")
    repaired(cli, tmp_path / "once", tmp_path / "twice")
    cj = json.loads((tmp_path / "twice" / "config.json").read_text())["quantization_config"]["mocli_repair"]
    hq = json.loads((tmp_path / "twice" / "hf_quant_config.json").read_text())["mocli_repair"]
    assert cj == hq and cj["source"] == {"path": str((tmp_path / "once").resolve())}
    assert cli("verify", tmp_path / "twice").exit_code == 0


@pytest.mark.parametrize("name", ["qwen3_moe-mxfp8", "qwen3_moe-w4a16_nvfp4"])
def test_experts_without_static_inputs_get_no_input_scale(cli, tmp_path, name):
    """MXFP8 (dynamic activations) and W4A16_NVFP4 (weight-only) experts carry no input_scale by design: repair
    has nothing to fill (it exited 3 on max() of no scales in 0.1.0) and copies the export as it is."""
    r = cli("--json", "repair", REAL / name, "-o", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert r.json["nothing_to_do"] and not r.json["repairs"]
    assert not any(n.endswith("input_scale") for n in load_tensors(tmp_path / "o"))


def test_a_config_relabelled_to_what_vllm_refuses_is_no_repair(cli, tmp_path):
    """ModelOpt's W4A8_MXFP4_FP8 export stores MXFP4 tensors under an algorithm mocli does not read: relabelling it
    "mxfp4" after the tensors would drop its FP8 activations and name what vLLM 0.33 refuses (VLL002), so repair
    refuses and writes nothing (0.1.0 relabelled it and its own verify failed the output)."""
    r = cli("--json", "repair", REAL / "llama-w4a8_mxfp4_fp8", "-o", tmp_path / "o")
    assert r.exit_code == 1
    assert "VLL002" in r.stderr and not (tmp_path / "o").exists()
    assert not list(tmp_path.glob("o*"))
