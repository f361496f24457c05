"""Every finding code is triggered by its broken fixture, through the CLI, with the right exit code."""

from __future__ import annotations

import pytest

from fixtures.generate import ALGOS, BROKEN, make_broken, make_checkpoint
from mocli.findings import CODES, Severity
from tests.conftest import REAL_LLAMA, REAL_QWEN


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
    full = cli("--json", "validate", path).json["findings"]
    r = cli("validate", path, "--output-format", "concise")
    lines = r.stdout.splitlines()
    assert r.exit_code == 1 and len(lines) == len(full) + 1 and lines[-1].startswith("FAILED")
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
