"""quantize (SEMANTICS §12): bytes against a second implementation written here, kept tensors
unchanged, the fp8 format recognised by inspect/validate, verify passing and failing as it should."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.generate import _edit_tensors, make_checkpoint
from tests.conftest import PYTHONPATH, digest_tree, load_tensors, run_killed, u8

FP8 = torch.float8_e4m3fn


def quantize_reference(ws: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """SEMANTICS §12 as written: s = amax(|float32(w)|) / 448 (1 when amax is 0); then
    fp8(clamp(float32(w) * (1/s), ±448)) with the float32 reciprocal taken first."""
    amax = max(float(w.float().abs().max()) for w in ws)
    s = torch.tensor(1.0) if amax == 0 else torch.tensor(amax, dtype=torch.float32) / 448
    inv = torch.reciprocal(s)
    return [(w.float() * inv).clamp(-448, 448).to(FP8) for w in ws], s


def groups_of(arch: str, layers: int = 2, experts: int = 4) -> list[list[str]]:
    g = []
    for i in range(layers):
        p = f"model.layers.{i}."
        g.append([p + f"self_attn.{x}_proj" for x in "qkv"])
        g.append([p + "self_attn.o_proj"])
        if arch == "llama":
            g += [[p + "mlp.gate_proj", p + "mlp.up_proj"], [p + "mlp.down_proj"]]
        else:
            block, (w1, w3, w2) = ("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral" else \
                ("mlp", ("gate_proj", "up_proj", "down_proj"))
            for e in range(experts):
                ep = f"{p}{block}.experts.{e}."
                g += [[ep + w1, ep + w3], [ep + w2]]
    return g


def quantized(cli, src, out, *extra):
    r = cli("--json", "quantize", src, "-o", out, *extra)
    assert r.exit_code == 0, r.stderr
    return r.json


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_bytes_equal_a_second_implementation(cli, tmp_path, arch):
    src = make_checkpoint(tmp_path / "src", arch=arch, algo="BF16", kv_cache=False)
    zero = "model.layers.1.self_attn.o_proj.weight"
    _edit_tensors(src, lambda t: t.__setitem__(zero, torch.zeros_like(t[zero])))  # an all-zero tensor
    summary = quantized(cli, src, tmp_path / "out")
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    for group in groups_of(arch):
        want, scale = quantize_reference([s[m + ".weight"] for m in group])
        for m, q in zip(group, want, strict=True):
            assert o[m + ".weight"].dtype == FP8 and torch.equal(u8(o[m + ".weight"]), u8(q)), m
            assert o[m + ".weight_scale"].shape == () and o[m + ".weight_scale"].dtype == torch.float32
            assert torch.equal(o[m + ".weight_scale"], scale), m
    assert float(o["model.layers.1.self_attn.o_proj.weight_scale"]) == 1.0 and not o[zero].view(torch.uint8).any()
    quant = {m + x for g in groups_of(arch) for m in g for x in (".weight", ".weight_scale")}
    for name, t in o.items():
        if name not in quant:
            assert torch.equal(u8(t), u8(s[name])), name  # kept tensors: the source's bytes
    assert set(o) == quant | (set(s) - quant)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and cfg["activation_scheme"] == "dynamic"
    kept = {"lm_head", "model.embed_tokens"} | ({f"model.layers.{i}.{'block_sparse_moe' if arch == 'mixtral' else 'mlp'}.gate"
                                                  for i in range(2)} if arch != "llama" else set())
    assert set(cfg["ignored_layers"]) == kept == set(summary["ignored_layers"])
    assert not any(k.endswith("input_scale") for k in o)  # dynamic activations


def test_output_validates_clean_and_verifies(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="BF16", kv_cache=False, shards=2)
    quantized(cli, src, tmp_path / "out")
    r = cli("--json", "validate", tmp_path / "out")
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]
    info = cli("--json", "inspect", tmp_path / "out").json
    assert info["quant_method"] == "fp8" and info["activation_scheme"] == "dynamic" and info["stored_schemes"] == ["FP8"]
    r = cli("--json", "verify", tmp_path / "out")
    assert r.exit_code == 0, [m["message"] for m in r.json["modules"] if not m["passed"]]
    kinds = {m["kind"] for m in r.json["modules"]}
    assert kinds == {"fp8_dynamic_linear", "fp8_dynamic_moe", "fp8_dynamic_expert_bytes"}
    for m in r.json["modules"]:
        if m["kind"] != "fp8_dynamic_expert_bytes":
            assert m["error"] < m["threshold"] and m["kernel"].startswith("torch._scaled_mm")
    assert r.json["coverage"]["unchecked"] == [] and r.json["files"]["checked"] == 1
    for cmd in (["convert", tmp_path / "out", "-o", tmp_path / "c", "--target", "flashinfer-cutlass"],
                ["repair", tmp_path / "out", "--dry-run"]):
        r = cli(*cmd)
        assert r.exit_code == 2 and "quant_method fp8" in r.stderr


def _mutate(out, fn):
    for f in out.glob("*.safetensors"):
        t = load_file(str(f))
        if fn(t):
            save_file(t, str(f), metadata={"format": "pt"})
            return
    raise AssertionError("nothing mutated")


@pytest.mark.parametrize("fault", ["scale x2", "experts exchanged", "shard from another layer", "kept tensor",
                                   "lm_head removed"])
def test_verify_catches_planted_faults(cli, tmp_path, fault):
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="BF16", kv_cache=False)
    out = tmp_path / "out"
    quantized(cli, src, out)
    p = "model.layers.0.block_sparse_moe.experts"

    def mutate(t):
        if fault == "scale x2":
            t["model.layers.0.self_attn.o_proj.weight_scale"] = t["model.layers.0.self_attn.o_proj.weight_scale"] * 2
        elif fault == "experts exchanged":
            t[f"{p}.0.w2.weight"], t[f"{p}.1.w2.weight"] = t[f"{p}.1.w2.weight"], t[f"{p}.0.w2.weight"]
        elif fault == "shard from another layer":
            t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"].clone()
        elif fault == "lm_head removed":
            del t["lm_head.weight"]
        else:
            t["model.norm.weight"] = t["model.norm.weight"] * 2
        return True

    _mutate(out, mutate)
    if fault == "lm_head removed":  # and from the index, as a careful attacker would
        idx = json.loads((out / "model.safetensors.index.json").read_text())
        del idx["weight_map"]["lm_head.weight"]
        (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = cli("--json", "verify", out)
    assert r.exit_code == 1
    assert r.json["files"]["problems"]  # the shard no longer matches its recorded SHA-256
    bad = [m["module"] for m in r.json["modules"] if not m["passed"]] + [x["tensor"] for x in r.json["passthrough"]["problems"]]
    assert bad, r.json
    if fault == "lm_head removed":  # completeness: a source tensor the output lacks is named
        assert "lm_head.weight" in bad


def test_exclusions_keep_whole_groups(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="BF16", kv_cache=False)
    summary = quantized(cli, src, tmp_path / "out", "--exclude", "*layers.1.self_attn.q_proj",
                        "--exclude", "model.layers.0.mlp.experts.3.*")
    o = load_tensors(tmp_path / "out")
    assert o["model.layers.1.self_attn.k_proj.weight"].dtype == torch.bfloat16  # the whole qkv group kept
    assert o["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16  # the whole MoE layer kept
    assert o["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == FP8
    assert {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
            "model.layers.0.mlp.experts"} <= set(summary["ignored_layers"])
    assert len(summary["notes"]) == 2
    r = cli("--json", "validate", tmp_path / "out")
    assert r.exit_code == 0 and r.json["findings"] == [], r.json["findings"]


def test_validate_judges_ignored_layers_with_the_fp8_rules(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="llama", algo="BF16", kv_cache=False)
    out = tmp_path / "out"
    quantized(cli, src, out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    ignored = cfg["quantization_config"]["ignored_layers"]
    for edit, code in ((ignored + ["model.layers.0.self_attn.o_proj"], "EXC003"),
                       ([x for x in ignored if x != "lm_head"] + ["model.layers.*.mlp.nothing"], "EXC001"),
                       (ignored + ["model.layers.0.self_attn.q_proj"], "EXC002"),
                       # the legacy substring rule is ModelOpt's, not fp8's: this entry matches nothing here
                       (ignored + ["self_attn.o_proj"], "EXC001")):
        cfg["quantization_config"]["ignored_layers"] = edit
        cfg_path.write_text(json.dumps(cfg))
        r = cli("--json", "validate", out)
        assert code in {f["code"] for f in r.json["findings"]}, (edit, r.json["findings"])
    del cfg["quantization_config"]["activation_scheme"]
    cfg_path.write_text(json.dumps(cfg))
    assert "CFG001" in {f["code"] for f in cli("--json", "validate", out).json["findings"]}


def test_refusals(cli, tmp_path):
    from tests.conftest import REAL_LLAMA

    r = cli("quantize", REAL_LLAMA, "-o", tmp_path / "o")
    assert r.exit_code == 2 and "already quantized" in r.stderr
    src = make_checkpoint(tmp_path / "src", algo="BF16", kv_cache=False)
    name = "model.layers.0.mlp.down_proj.weight"

    def nan(t):
        w = t[name].clone()
        w[1, 2] = float("nan")
        t[name] = w

    _edit_tensors(src, nan)
    r = cli("quantize", src, "-o", tmp_path / "o")
    assert r.exit_code == 1 and "DAT001" in r.stderr and name in r.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.mocli-*"))
    r = cli("quantize", src, "-o", tmp_path / "o", "--scheme", "int4")
    assert r.exit_code == 2


@pytest.mark.slow
def test_kill_9_then_resume_is_byte_identical(tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="BF16", kv_cache=False, experts=8, shards=2)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    args = ["-q", "quantize", str(src), "-o", str(tmp_path / "o")]
    p = run_killed(args, after=40)
    assert p.returncode == -9 and (tmp_path / ".o.mocli-partial").is_dir()
    p = subprocess.run([sys.executable, "-m", "mocli", "--json", *args[1:]], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed_units"] > 0
    p = subprocess.run([sys.executable, "-m", "mocli", "-q", "quantize", str(src), "-o", str(tmp_path / "clean")], env=env)
    assert p.returncode == 0
    assert digest_tree(tmp_path / "o") == digest_tree(tmp_path / "clean")


@pytest.mark.gpu
def test_cuda_is_byte_identical_to_cpu(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="BF16", kv_cache=False)
    for dev in ("cpu", "cuda"):
        assert cli("-q", "quantize", src, "-o", tmp_path / dev, "--device", dev).exit_code == 0
    assert digest_tree(tmp_path / "cpu") == digest_tree(tmp_path / "cuda")
    r = cli("--json", "verify", tmp_path / "cuda", "--device", "cuda")
    assert r.exit_code == 0
    assert all(m["kernel"].startswith("torch._scaled_mm") for m in r.json["modules"] if "bytes" not in m["kind"])


@pytest.mark.parametrize("arch,routers", [("qwen3_moe", 2), ("mixtral", 0)])
def test_routers_stay_bf16_and_the_difference_from_vllm_online_is_stated(cli, tmp_path, arch, routers):
    """SEMANTICS §12 keeps routers in BF16; vLLM 0.32.0's online fp8_per_tensor quantizes Qwen3-MoE's
    router (GateLinear with the quant config) but not Mixtral's: the summary says so per layer."""
    src = make_checkpoint(tmp_path / "src", arch=arch, algo="BF16", kv_cache=False)
    summary = quantized(cli, src, tmp_path / "out")
    gate = "mlp.gate" if arch == "qwen3_moe" else "block_sparse_moe.gate"
    o, s = load_tensors(tmp_path / "out"), load_tensors(src)
    for i in range(2):
        name = f"model.layers.{i}.{gate}.weight"
        assert o[name].dtype == torch.bfloat16 and torch.equal(o[name], s[name])
        assert f"model.layers.{i}.{gate}" in summary["ignored_layers"]
    dev = summary["deviations_from_online"]
    assert [d["layer"] for d in dev] == ([f"model.layers.{i}.{gate}" for i in range(2)] if routers else [])
    assert all("vLLM 0.32.0" in d["engine_online"] for d in dev)


def test_verify_folds_byte_only_checks_per_layer(cli, tmp_path):
    """A person reads one row per MoE layer for the experts' byte checks; --json keeps every one."""
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="BF16", kv_cache=False)
    quantized(cli, src, tmp_path / "out")
    detail = cli("--json", "verify", tmp_path / "out").json["modules"]
    per_expert = [m for m in detail if m["kernel"] == "bytes and scale only"]
    assert len(per_expert) == 2 * 4 * 2  # layers x experts x (w13, w2)
    r = cli("verify", tmp_path / "out")
    rows = [x for x in r.stdout.splitlines() if "expert groups" in x]
    assert len(rows) == 2 and all("bytes and scales of 8 expert groups" in x and "pass" in x for x in rows)
    assert "bytes and scale only" not in r.stdout
