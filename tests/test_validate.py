"""Every finding code is triggered by its broken fixture, through the CLI, with the right exit code."""

from __future__ import annotations

import pytest

from fixtures.generate import ALGOS, BROKEN, make_broken, make_checkpoint
from mocli.findings import CODES, Severity
from tests.conftest import REAL, REAL_LLAMA, REAL_QWEN


def test_every_code_has_a_broken_fixture():
    assert set(BROKEN) == set(CODES)


@pytest.mark.parametrize("code", sorted(CODES))
def test_broken_fixture_triggers_its_code(cli, tmp_path, code):
    path, args = make_broken(code, tmp_path / code)
    r = cli("--json", "validate", path, *args)
    report = r.json
    found = [f for f in report["findings"] if f["code"] == code]
    assert found, f"{code} not reported; got {[f['code'] for f in report['findings']]}"
    f = found[0]
    assert f["severity"] == str(CODES[code][0]) and f["location"] and f["message"]
    has_errors = any(x["severity"] == "error" for x in report["findings"])
    assert r.exit_code == (1 if has_errors else 0)
    if CODES[code][0] is Severity.ERROR:
        assert r.exit_code == 1 and report["ok"] is False


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm"])
@pytest.mark.parametrize("path", [REAL_LLAMA, REAL_QWEN], ids=["llama-fp8", "qwen3-moe-nvfp4"])
def test_real_exports_validate_clean(cli, path, target):
    r = cli("--json", "validate", path, "--target", target)
    assert r.exit_code == 0, r.stdout
    assert r.json["findings"] == []


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("shards", [1, 3])
def test_generated_checkpoints_validate_clean(cli, tmp_path, arch, algo, shards):
    if arch != "llama" and algo == "FP8_PER_CHANNEL_PER_TOKEN":
        pytest.skip("no FlashInfer fused-MoE path for this scheme; covered by TGT002")
    mixed = {"self_attn": "FP8", "mlp": "NVFP4", "block_sparse_moe": "FP8"} if algo == "MIXED_PRECISION" else {}
    path = make_checkpoint(tmp_path / "m", arch=arch, algo=algo, shards=shards, mixed=mixed)
    r = cli("--json", "validate", path, "--target", "flashinfer-trtllm")
    assert r.exit_code == 0 and r.json["findings"] == [], r.stdout


def test_scale_stats_report_fp8_spread_and_nvfp4_mismatch(cli, tmp_path):
    r = cli("--json", "validate", REAL_LLAMA)
    s = r.json["stats"]["scales"]
    # q/k/v and gate/up per layer; the real export's shard scales differ by ~1.07-1.14x
    assert s["fp8_groups"] == 4 and 1.0 < s["fp8_max_spread"] < 1.2
    path, _ = make_broken("SCL005", tmp_path / "m")
    s = cli("--json", "validate", path).json["stats"]["scales"]
    assert s["nvfp4_scale2_mismatched"] > 0 and s["nvfp4_worst_ratio"] > 1.0


def test_scale_2_mismatch_is_summarised_per_moe_layer(cli, tmp_path):
    path, _ = make_broken("SCL005", tmp_path / "m")
    found = {f["location"]: f["message"] for f in cli("--json", "validate", path).json["findings"]
             if f["code"] == "SCL005"}
    # unify_scale_2=False: every expert's w1/w3 differ (4 experts, 2 MoE layers), and both qkv groups
    assert found["model.layers.0.mlp.experts"].startswith("4 groups")
    assert found["model.layers.1.mlp.experts"].startswith("4 groups")
    assert found["qkv_proj"].startswith("2 groups")


def test_human_output_lists_findings_and_verdict(cli, tmp_path):
    path, _ = make_broken("SCL001", tmp_path / "m")
    r = cli("validate", path)
    assert r.exit_code == 1
    assert "SCL001" in r.stdout and "FAILED" in r.stdout


def test_readme_lists_every_code_with_its_severity_and_text():
    """The README's table is what CI users grep for: it must not drift from the codes validate emits."""
    from tests.conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in readme.splitlines()
            if line.startswith("| `") and line.count("|") == 4}
    for code, (severity, text) in CODES.items():
        assert code in rows, f"{code} missing from README's code table"
        assert f"| {severity.value} | {text} |" in rows[code], f"README row for {code} differs: {rows[code]}"
    import re

    assert not {c for c in rows if re.fullmatch(r"[A-Z]{3}\d{3}", c)} - set(CODES), "README lists an unknown code"


def test_concise_format_is_one_line_per_finding(cli, tmp_path):
    path, _ = make_broken("EXC003", tmp_path / "m")
    report = cli("--json", "validate", path).json
    full = report["findings"]
    r = cli("validate", path, "--output-format", "concise")
    lines = r.stdout.splitlines()
    # one line per finding (unfolded), the verdict, then one line per thing not judged (here: no --target)
    assert r.exit_code == 1 and len(lines) == len(full) + 1 + len(report["not_judged"]) == len(full) + 2
    assert lines[len(full)].startswith("FAILED for vLLM") and lines[-1].startswith("not judged: target constraints")
    for f, line in zip(full, lines, strict=False):
        assert line == f"{f['location']}: {f['code']} {f['severity']}: {f['message']} (hint: {f['hint']})"


def test_select_ignore_and_warnings_as_errors(cli, tmp_path):
    path, _ = make_broken("EXC001", tmp_path / "m")  # one warning
    assert cli("validate", path).exit_code == 0
    assert cli("validate", path, "--warnings-as-errors").exit_code == 1
    r = cli("--json", "validate", path, "--ignore", "EXC", "--warnings-as-errors")
    assert r.exit_code == 0 and r.json["findings"] == [] and r.json["ignored"] == 1
    r = cli("--json", "validate", path, "--select", "SCL")
    assert r.json["findings"] == [] and r.json["ignored"] == 1
    err, _ = make_broken("EXC003", tmp_path / "e")
    r = cli("--json", "validate", err, "--select", "EXC001")
    assert r.exit_code == 0 and r.json["ok"]  # the error was not selected


def test_expert_parallel_needs_moe_layers(cli):
    r = cli("--json", "validate", REAL_LLAMA, "--tp", "2", "--ep", "4")
    assert r.exit_code == 1
    assert any(f["code"] == "PAR002" and "no quantized MoE layer" in f["message"] for f in r.json["findings"])
    r = cli("convert", REAL_LLAMA, "-o", "/nonexistent-never-written", "--target", "flashinfer-cutlass", "--tp", "2",
            "--ep", "4")
    assert r.exit_code == 1 and "PAR002" in r.stderr


def test_deep_scan_asks_the_scheme_for_nan_codes(cli, real_copy):
    """MXFP8's U8 E8M0 scales have a NaN code (255) that no dtype rule knows; --deep finds it through the
    module's scheme, on a real ModelOpt 0.47 export."""
    from safetensors.torch import load_file, save_file

    d = real_copy("llama-mxfp8")
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    r = cli("--json", "validate", d, "--deep")
    assert not [f for f in r.json["findings"] if f["code"] == "DAT001"], r.json["findings"]
    tensors = load_file(str(d / "model.safetensors"))
    tensors[name][3, 2] = 255
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    r = cli("--json", "validate", d, "--deep")
    dat = [f for f in r.json["findings"] if f["code"] == "DAT001"]
    assert [f["location"] for f in dat] == [name] and "0xFF" in dat[0]["message"], dat


# --- what validate judged (issue 44 items 3 and 4) ----------------------------------------------------------

def test_sglang_on_compressed_tensors_is_not_judged_never_ok(cli):
    """The false green: SGLang's reading of compressed-tensors is not restated, so --engine sglang judges
    no engine at all: NOT JUDGED and exit 2 (as for a question mocli cannot answer), never OK and 0."""
    src = REAL / "llama-ct-nvfp4"
    r = cli("--json", "validate", src, "--engine", "sglang")
    assert r.exit_code == 2 and r.json["ok"] is False and r.json["verdict"] == "not judged"
    assert r.json["findings"] == [] and r.json["judged"]["engines"] == []
    assert [n["name"] for n in r.json["not_judged"] if n["what"] == "engine"] == ["sglang"]
    assert "nothing judged" in r.stderr and "compressed-tensors" in r.stderr
    human = cli("validate", src, "--engine", "sglang")
    assert human.exit_code == 2 and "OK" not in human.stdout.replace("NOT JUDGED", "")
    assert human.stdout.startswith("NOT JUDGED (no target, tp 1, ep 1)")
    assert "not judged: SGLang 0.5.23: its reading of compressed-tensors is not restated" in human.stdout
    # --engine all judges vLLM's reading and says SGLang's was not
    r = cli("--json", "validate", src, "--engine", "all")
    assert r.exit_code == 0 and r.json["ok"] and r.json["judged"]["engines"] == ["vllm"]
    assert "sglang" in [n["name"] for n in r.json["not_judged"]]


def test_the_verdict_names_engines_target_and_layout(cli):
    r = cli("validate", REAL_LLAMA, "--target", "flashinfer-cutlass", "--tp", "2", "--engine", "all")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[0] == ("OK for vLLM 0.32-0.33 and SGLang 0.5.23 (target flashinfer-cutlass, tp 2, "
                                        "ep 1): 0 error(s), 0 warning(s)")
    assert "not judged" not in r.stdout
    j = cli("--json", "validate", REAL_LLAMA, "--target", "flashinfer-cutlass", "--tp", "2", "--engine", "all").json
    assert j["judged"] == {"engine": "all", "engines": ["vllm", "sglang"], "target": "flashinfer-cutlass", "tp": 2,
                           "ep": 1, "deep": False, "labels": {"vllm": "vLLM 0.32-0.33", "sglang": "SGLang 0.5.23"}}
    assert j["not_judged"] == [] and j["ok"] is True and j["verdict"] == "ok"
    lines = cli("validate", REAL_LLAMA).stdout.splitlines()
    assert lines == ["OK for vLLM 0.32-0.33 (no target, tp 1, ep 1): 0 error(s), 0 warning(s)",
                     "not judged: target constraints: no --target given (flashinfer-cutlass, flashinfer-trtllm, marlin)"]


def test_a_finding_repeated_per_layer_is_one_row_with_a_count(cli):
    """llama-ct-nvfp4a16: 2 layers x 4 linears (q/k/v, o, gate/up, down) stored W4A16, which
    flashinfer-cutlass does not take: 8 findings, one row; qwen3_moe-mxfp8: 2 MoE layers, one row (x2)."""
    src = REAL / "llama-ct-nvfp4a16"
    j = cli("--json", "validate", src, "--target", "flashinfer-cutlass").json
    assert len(j["findings"]) == 8 and j["errors"] == 8  # one entry per finding, as before
    (row,) = j["grouped"]
    assert row["code"] == "TGT002" and row["count"] == 8 and len(row["locations"]) == 8
    assert row["location"].startswith("model.layers.{0,1}: ") and "self_attn.o_proj" in row["location"]
    r = cli("validate", src, "--target", "flashinfer-cutlass")
    rows = [x for x in r.stdout.splitlines() if "TGT002" in x]
    assert len(rows) == 1 and "(×8)" in rows[0] and r.exit_code == 1
    r = cli("validate", REAL / "qwen3_moe-mxfp8", "--target", "flashinfer-cutlass")
    rows = [x for x in r.stdout.splitlines() if "TGT002" in x]
    assert len(rows) == 1 and "model.layers.{0,1}.mlp.experts" in rows[0] and "(×2)" in rows[0]
    concise = cli("validate", src, "--target", "flashinfer-cutlass", "--output-format", "concise").stdout
    assert sum("TGT002" in x for x in concise.splitlines()) == 8  # concise stays one line per finding


def test_grouping_within_and_across_layers():
    from mocli.validate.grouping import group_findings

    def f(loc, msg="m", code="TGT001"):
        return {"code": code, "severity": "error", "location": loc, "message": msg, "hint": "h"}

    found = [f("model.layers.0.a"), f("model.layers.0.b"), f("model.layers.1.a"), f("model.layers.1.b"),
             f("model.layers.2.a"), f("model.layers.5.a"), f("model.layers.5.b"), f("model.layers.6.a"),
             f("model.layers.6.b"), f("quant_algo", code="VLL001"),
             f("model.layers.3.c", "N = 8 at model.layers.3.c"), f("model.layers.4.c", "N = 8 at model.layers.4.c"),
             f("model.layers.7.a", "other"),
             # a layer's location starts its experts' names: they keep theirs, the layer's number taken out
             f("model.layers.8.experts", "w1 of model.layers.8.experts.3 differs", "SCL005"),
             f("model.layers.9.experts", "w1 of model.layers.9.experts.3 differs", "SCL005")]
    rows = {r["location"]: (r["count"], r["message"]) for r in group_findings(found)}
    assert rows == {"model.layers.{0,1,5,6}: a, b": (8, "m"),  # the same modules in each layer
                    "model.layers.2.a": (1, "m"),  # a different set of modules: its own row
                    "quant_algo": (1, "m"),
                    "model.layers.{3,4}.c": (2, "N = 8 at each"),  # the module's own name taken out
                    "model.layers.7.a": (1, "other"),
                    "model.layers.{8,9}.experts": (2, "w1 of model.layers.{8,9}.experts.3 differs")}
    numbers = group_findings([f(f"m.layers.{i}.x") for i in (0, 1, 2, 3, 7, 9, 10)])
    assert [r["location"] for r in numbers] == ["m.layers.{0-3,7,9,10}.x"]


@pytest.mark.parametrize("target", [None, "flashinfer-cutlass"])
def test_vll001_whenever_vllm_is_judged(cli, target):
    """vLLM refuses NVFP4_AWQ (0.32.0's CPU wheel read: modelopt.py :: ModelOptQuantConfigBase.from_config,
    QUANT_ALGOS has no NVFP4_AWQ), with or without --target."""
    args = ["--target", target] if target else []
    src = REAL / "llama-nvfp4_awq"
    found = cli("--json", "validate", src, *args).json["findings"]
    (vll,) = [f for f in found if f["code"] == "VLL001"]
    assert "vLLM 0.32 and 0.33 refuse NVFP4_AWQ" in vll["message"]
    assert not [f for f in cli("--json", "validate", src, "--engine", "sglang", *args).json["findings"]
                if f["code"] == "VLL001"]


def test_convert_leaves_vll001_out_of_its_warnings(cli, tmp_path):
    r = cli("--json", "convert", REAL / "llama-nvfp4_awq", "-o", tmp_path / "o", "--target", "flashinfer-cutlass")
    assert r.exit_code == 0 and not [w for w in r.json["warnings"] if w["code"] == "VLL001"]


def test_each_wrong_expert_scale_is_named_among_alike_experts(cli, tmp_path):
    """validate checks a module's scale tensors once per kind of module (scheme, kind, suffixes, dtypes,
    shapes); a module found wrong is never taken for a checked one. Experts 1 and 3's w2 block scales stored
    BF16 among experts alike: each of the two is named, and no other expert is."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    src = make_checkpoint(tmp_path / "src", arch="mixtral", algo="NVFP4")
    t = load_file(str(src / "model.safetensors"))
    ep = "model.layers.0.block_sparse_moe.experts"
    for e in (1, 3):
        t[f"{ep}.{e}.w2.weight_scale"] = t[f"{ep}.{e}.w2.weight_scale"].to(torch.bfloat16)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = cli("--json", "validate", src)
    assert r.exit_code == 1
    named = sorted(f["location"] for f in json.loads(r.stdout)["findings"] if f["code"] == "TNS002")
    assert named == [f"{ep}.1.w2.weight_scale", f"{ep}.3.w2.weight_scale"]
