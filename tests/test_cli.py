"""Every command and error path through the CLI, with asserted exit codes and --json output."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fixtures.generate import CORRUPTIONS, corrupt, make_checkpoint
from mocli import __version__
from tests.conftest import REAL, REAL_QWEN


def test_version(cli):
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"mocli {__version__}"


def test_help_lists_commands(cli):
    r = cli("--help", env={"COLUMNS": "200"})
    assert r.exit_code == 0
    summary = r.stdout.split("Options")[0].lower()  # the one-line description names every command
    for cmd in ("inspect", "validate", "repair", "quantize", "convert", "verify"):
        assert f"│ {cmd} " in r.stdout and cmd in summary, (cmd, summary)
    # convert only moves bytes on the CPU: its --device help must not promise CUDA
    device = cli("convert", "--help", env={"COLUMNS": "200"}).stdout.split("--device")[1].split("--overwrite")[0]
    assert "runs on the CPU" in " ".join(device.split()) and "picks CUDA" not in device


def test_no_args_shows_help_and_is_a_usage_error(cli):
    assert cli().exit_code == 2


def test_inspect_json_real_moe(cli):
    r = cli("--json", "inspect", REAL_QWEN)
    assert r.exit_code == 0 and r.stderr == ""
    info = r.json
    assert info["architecture"] == "Qwen3MoeForCausalLM"
    assert info["quant_algo"] == "NVFP4" and info["kv_cache_quant_algo"] == "FP8" and info["group_size"] == 16
    assert info["producer"] == {"name": "modelopt", "version": "0.47.0"}
    assert info["num_tensors"] == 241 and info["total_bytes"] == (REAL_QWEN / "model.safetensors").stat().st_size
    assert info["dtypes"]["U8"]["tensors"] == 56  # 2 layers x (4 attn + 8 experts x 3)
    assert [(m["experts"], m["intermediate"], m["hidden"]) for m in info["moe_layers"]] == [(8, 128, 256)] * 2
    assert {e["pattern"]: e["matches"] for e in info["exclusions"]}["model.layers.1.mlp.gate"] == [
        "model.layers.1.mlp.gate"]


def test_json_flag_after_the_command(cli):
    assert cli("inspect", REAL_QWEN, "--json").json["quant_algo"] == "NVFP4"


def test_inspect_human(cli):
    r = cli("inspect", REAL_QWEN)
    assert r.exit_code == 0
    for s in ("Qwen3MoeForCausalLM", "NVFP4", "MoE layers", "exclusions"):
        assert s in r.stdout
    # its two MoE layers alike, one row; its exclude_modules names each layer's router, one row
    assert "model.layers.{0..1}.mlp.experts (2 layers)" in r.stdout
    assert "model.layers.0.mlp.experts" not in r.stdout
    assert "model.layers.{0..1}.mlp.gate (2 patterns)" in r.stdout


def test_inspect_tables_fold_layers_alike():
    from mocli.render import SELF, by_layer_runs

    same, other = ("qwen", "128"), ("qwen", "64")
    rows = [("model.layers.0.mlp.experts", same), ("model.layers.1.mlp.experts", same),
            ("model.layers.2.mlp.experts", same), ("model.layers.4.mlp.experts", same),  # 3 is dense
            ("model.layers.5.mlp.experts", other),  # another shape: a row of its own
            ("model.layers.6.mlp.experts", same),  # alike again, but not next to the first run
            ("model.layers.7.block_sparse_moe", same),  # another name around the index
            ("model.layers.8.block_sparse_moe", same),
            ("lm_head", (SELF, "")), ("model.embed_tokens", (SELF, ""))]  # no index: never folded
    assert by_layer_runs(rows, "layers") == [
        ("model.layers.{0..2,4}.mlp.experts (4 layers)", same), ("model.layers.5.mlp.experts", other),
        ("model.layers.6.mlp.experts", same), ("model.layers.{7..8}.block_sparse_moe (2 layers)", same),
        ("lm_head", (SELF, "")), ("model.embed_tokens", (SELF, ""))]
    # a pattern that names a layer and nothing after it (ModelOpt's exclude_modules can)
    assert by_layer_runs([("model.layers.3", ("x",)), ("model.layers.9", ("x",))], "patterns") == [
        ("model.layers.{3,9} (2 patterns)", ("x",))]


def test_inspect_sharded_and_config_style(cli, tmp_path):
    path = make_checkpoint(tmp_path / "m", arch="mixtral", algo="FP8", shards=3, config_style="config")
    info = cli("--json", "inspect", path).json
    assert info["sharded"] and len(info["shards"]) == 3 and info["config_files"] == ["config.json"]
    assert info["moe_layers"][0]["naming"] == "mixtral"


@pytest.mark.parametrize("cmd", ["inspect", "validate"])
@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_input_is_one_line_exit_2(cli, tmp_path, cmd, kind):
    path = make_checkpoint(tmp_path / "m", shards=2 if kind == "outside_dir" else 1)
    corrupt(path, kind)
    r = cli(cmd, path)
    assert r.exit_code == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr


def test_index_disagreements(cli, tmp_path):
    path = make_checkpoint(tmp_path / "m", shards=2)
    index = path / "model.safetensors.index.json"
    j = json.loads(index.read_text())
    name = next(iter(j["weight_map"]))
    other = [f for f in set(j["weight_map"].values()) if f != j["weight_map"][name]][0]
    j["weight_map"][name] = other
    index.write_text(json.dumps(j))
    r = cli("inspect", path)
    assert r.exit_code == 2 and "mapped to" in r.stderr
    del j["weight_map"][name]
    index.write_text(json.dumps(j))
    r = cli("inspect", path)
    assert r.exit_code == 2 and "missing from the weight_map" in r.stderr


def test_tensor_in_two_shards(cli, tmp_path):
    path = make_checkpoint(tmp_path / "m", shards=2)
    files = sorted(path.glob("model-*.safetensors"))
    shutil.copy(files[0], files[1])
    r = cli("inspect", path)
    assert r.exit_code == 2 and "stored in both" in r.stderr


def test_missing_path_and_not_a_checkpoint(cli, tmp_path):
    r = cli("inspect", tmp_path / "nope")
    assert r.exit_code == 2 and "no such directory" in r.stderr
    r = cli("inspect", tmp_path)
    assert r.exit_code == 2 and "no safetensors" in r.stderr
    (tmp_path / "f.txt").write_text("x")
    r = cli("inspect", tmp_path / "f.txt")
    assert r.exit_code == 2 and "not a directory" in r.stderr


def test_bad_target_is_usage_error(cli):
    assert cli("validate", REAL_QWEN, "--target", "bogus").exit_code == 2


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty, private HF cache (huggingface_hub reads its cache path at import time)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_offline_not_cached(cli, hub_cache):
    r = cli("inspect", "nvidia/not-cached-model", env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 2 and "HF_HUB_OFFLINE" in r.stderr


def test_hub_offline_from_cache(cli, hub_cache):
    # The layout huggingface_hub uses: models--org--name/{refs/main, snapshots/<rev>/...}
    repo = hub_cache / "models--org--tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(REAL_QWEN, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    r = cli("--json", "inspect", "org/tiny", env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.stderr
    assert r.json["source"] == f"org/tiny@{rev}" and r.json["quant_algo"] == "NVFP4"


def test_internal_error_is_exit_3_without_traceback(cli, monkeypatch):
    import mocli.inspection

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(mocli.inspection, "inspect_checkpoint", boom)
    r = cli("inspect", REAL_QWEN)
    assert r.exit_code == 3 and "internal error" in r.stderr and "Traceback" not in r.stderr


def test_quiet_suppresses_warnings(cli, tmp_path):
    path = make_checkpoint(tmp_path / "m")
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP7"}}))
    assert "warning" in cli("inspect", path).stderr
    assert cli("-q", "inspect", path).stderr == ""


def test_verbose_reports_timing_and_traceback(cli, monkeypatch):
    r = cli("-v", "inspect", REAL_QWEN)
    assert r.exit_code == 0 and "inspect finished in" in r.stderr
    import mocli.inspection

    monkeypatch.setattr(mocli.inspection, "inspect_checkpoint", lambda *a, **k: 1 / 0)
    r = cli("-vv", "inspect", REAL_QWEN)
    assert r.exit_code == 3 and "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr


def test_human_output_is_not_wrapped_off_a_terminal(cli, tmp_path):
    """In a pipe or a CI log, a summary or a finding is one line whatever its length (ruff, pip)."""
    out = tmp_path / ("a-long-output-directory-name-" * 4)
    r = cli("convert", REAL_QWEN, "-o", out, "--target", "flashinfer-cutlass")
    assert r.exit_code == 0
    line = next(x for x in r.stdout.splitlines() if x.startswith("converted"))
    assert line.endswith(f"-> {out}") and len(line) > 160
    path = make_checkpoint(tmp_path / "m")
    hint = "the engine will load quantized bytes as BF16; fix exclude_modules"
    from fixtures.generate import _both_exclude

    _both_exclude(lambda ex: ex.append("model.layers.0.self_attn.o_proj"))(path)
    r = cli("validate", path)
    row = next(x for x in r.stdout.splitlines() if "EXC003" in x)
    assert "excluded by the config but 1 module(s) are stored quantized" in row and hint in row


def test_colon_names_are_printed_as_they_are(cli, tmp_path):
    """rich reads ``:smile:`` as an emoji code by default: a path or tensor name between colons must print as is."""
    out = tmp_path / "run:smile:1"
    r = cli("convert", REAL_QWEN, "-o", out, "--target", "flashinfer-cutlass")
    assert r.exit_code == 0
    assert next(x for x in r.stdout.splitlines() if x.startswith("converted")).endswith(f"-> {out}")


def test_help_reads_like_other_clis(cli):
    r = cli("convert", "--help", env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "Usage: mocli convert [OPTIONS] MODEL" in r.stdout and "{MODEL}" not in r.stdout
    assert "<bool>" not in r.stdout and "<int>" not in r.stdout and "<str>" not in r.stdout
    assert "owner/name[@revision]" in r.stdout  # not eaten as markup
    assert "Exit codes: 0 ok; 1 findings" in r.stdout
    top = cli("--help", env={"COLUMNS": "200"}).stdout
    assert "--install-completion" in top and "-V" in top and "<bool>" not in top
    assert cli("-V").stdout.strip() == f"mocli {__version__}"


def test_json_errors_are_a_json_object_on_stdout(cli, tmp_path):
    r = cli("--json", "inspect", tmp_path / "nothing")
    assert r.exit_code == 2 and "error:" in r.stderr
    err = r.json["error"]
    assert err["exit_code"] == 2 and "no such directory" in err["message"] and err["hint"]


@pytest.mark.parametrize("text,nbytes", [("2GiB", 2 * 1024**3), ("512 MiB", 512 * 1024**2), ("5GB", 5 * 1000**3),
                                         ("500mb", 500 * 1000**2), ("1.5GiB", int(1.5 * 1024**3)), ("4096", 4096)])
def test_sizes_in_both_spellings(text, nbytes):
    from mocli.cli import parse_size

    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["2GiBs", "-1GB", "0", "GB", "two"])
def test_bad_sizes_are_usage_errors(cli, tmp_path, text):
    r = cli("convert", REAL_QWEN, "-o", tmp_path / "o", "--target", "flashinfer-cutlass", "--max-shard-size", text)
    assert r.exit_code == 2 and "not a size" in r.stderr


def test_progress_lines_in_logs(cli, tmp_path):
    """Off a terminal a long run prints plain lines (binary units, as the summary), never a bar."""
    r = cli("convert", REAL_QWEN, "-o", tmp_path / "o", "--target", "flashinfer-cutlass",
            env={"MOCLI_PROGRESS_SECONDS": "0"})
    assert r.exit_code == 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("converting: ")]
    assert any("units" in x and "%" in x and "iB of 1.57 MiB" in x and "(w13:" in x for x in lines), lines
    assert "\r" not in r.stderr and "━" not in r.stderr
    quiet = cli("-q", "convert", REAL_QWEN, "-o", tmp_path / "q", "--target", "flashinfer-cutlass",
                env={"MOCLI_PROGRESS_SECONDS": "0"})
    assert quiet.stderr == ""


def test_make_install_keeps_an_installed_torch(tmp_path):
    """`make install` pins torch only where none is installed (a vLLM or SGLang environment keeps its own)."""
    import subprocess

    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                    'if [ "$1" = "-c" ]; then [ -n "$HAS_TORCH" ]; exit $?; fi\nexit 0\n')
    fake.chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    for has in ("1", ""):
        log.write_text("")
        p = subprocess.run(["make", "-s", "-C", str(root), "install", f"PYTHON={fake}"], env={**os.environ,
                           "HAS_TORCH": has}, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        calls = log.read_text()
        assert ("torch==2.13.0" in calls) is (not has), calls
        assert '-e .[dev]' in calls


# --- help and output as a new user meets them (issue 44 item 6) ---------------------------------------------

def _flat(help_text: str) -> str:
    """--help as one line: rich's box borders and line wrapping taken out."""
    return " ".join(help_text.replace("│", " ").split())


# one real export per stored scheme, for the linears each target takes
LINEAR_EXPORTS = {"MXFP8": "llama-mxfp8", "FP8": "llama-fp8_kv", "FP8_PB_WO": "llama-ct-fp8_block",
                  "FP8_PER_CHANNEL_PER_TOKEN": "llama-ct-fp8_dynamic", "W4A16_NVFP4": "llama-w4a16_nvfp4",
                  "NVFP4_AWQ": "llama-nvfp4_awq", "NVFP4": "llama-nvfp4_four_over_six", "MXFP4": "llama-ct-mxfp4"}


def test_convert_help_describes_each_target_from_the_registry(cli):
    from mocli.targets import Target, describe

    text = _flat(cli("convert", "--help", env={"COLUMNS": "200"}).stdout)
    for t in Target:
        assert f"{t.value}: {describe(t)}." in text, t
    assert "NVFP4 weight-only" not in text  # the old claim: marlin takes FP8 and MXFP8 linears too
    assert "convert --help says what each takes" in _flat(cli("validate", "--help", env={"COLUMNS": "200"}).stdout)


@pytest.mark.parametrize("target", ["flashinfer-cutlass", "flashinfer-trtllm", "marlin"])
def test_the_linears_help_says_a_target_takes_are_the_ones_it_takes(cli, target):
    """What --help says a target takes, against what validate finds on a real export of each scheme
    (TGT002 where the target has no path)."""
    from mocli.targets import takes

    said = set(takes(target, "linear").split(", "))
    assert said <= set(LINEAR_EXPORTS)
    for algo, name in LINEAR_EXPORTS.items():
        found = cli("--json", "validate", REAL / name, "--target", target).json["findings"]
        refused = any(f["code"] == "TGT002" for f in found)
        assert refused == (algo not in said), (target, algo, found)
    if target == "marlin":  # the case: FP8 and MXFP8 linears too, not NVFP4 weight-only
        assert {"FP8", "MXFP8", "NVFP4", "W4A16_NVFP4"} <= said


def test_quantize_and_top_help_say_what_they_read_and_do(cli):
    from mocli.schemes import FP8

    quantize = _flat(cli("quantize", "--help", env={"COLUMNS": "200"}).stdout)
    # vLLM 0.32's fp8 refuses online quantization ("Please use `--quantization fp8_per_tensor`", fp8.py ::
    # Fp8Config.__init__)
    assert "--quantization fp8_per_tensor" in quantize and f"fp8: {FP8.summary}" in quantize
    top = _flat(cli("--help", env={"COLUMNS": "200"}).stdout)
    assert "ModelOpt" in top and "compressed-tensors" in top and "FP8" in top


def test_convert_says_what_to_run_next(cli, tmp_path):
    out = tmp_path / "out dir"
    r = cli("convert", REAL_QWEN, "-o", out, "--target", "flashinfer-cutlass")
    assert r.exit_code == 0 and r.stdout.splitlines()[-1] == f"next: mocli verify '{out}'"
    r = cli("--json", "convert", REAL_QWEN, "-o", tmp_path / "j", "--target", "flashinfer-cutlass")
    assert "next" not in r.json and "mocli verify" not in r.stdout


def test_piped_output_has_no_trailing_whitespace(cli):
    """rich pads grid and table lines to the table's width; off a terminal nothing ends in a space."""
    for args in (("inspect", REAL_QWEN), ("validate", REAL / "qwen3_moe-mxfp8", "--target", "flashinfer-cutlass")):
        r = cli(*args)
        lines = r.stdout.splitlines()
        assert len(lines) > 3 and not [x for x in lines if x != x.rstrip()], args
        assert any(" " in x.strip() for x in lines)  # the columns are still spaced


def test_trace_writes_each_mark_as_one_line(monkeypatch):
    """MOCLI_TRACE marks from threads ran together: each is now one write(2) of a whole line, with no lock
    (a worker forked while another thread held one waited on it for ever)."""
    import os
    import threading

    from mocli import trace

    writes: list[str] = []
    real = os.write

    def write(fd, data):
        if fd != 2:
            return real(fd, data)
        writes.append(data.decode())
        return len(data)

    monkeypatch.setattr(trace, "ON", True)
    monkeypatch.setattr(os, "write", write)
    threads = [threading.Thread(target=lambda i=i: [trace.mark(f"t{i} m{j}") for j in range(50)]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(writes) == 200
    assert all(w.startswith("[trace] ") and w.endswith("\n") and w.count("\n") == 1 for w in writes)
    assert not any(isinstance(v, type(threading.Lock())) for v in vars(trace).values())


def _readme_table(header: str) -> dict[str, list[str]]:
    """README's table under ``header`` (its first row), as first cell (backticks off) -> the row's cells."""
    from tests.conftest import ROOT

    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(header)
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_readme_tables_of_targets_and_schemes_are_the_registry():
    """README's target and scheme tables say what the registries say (and so what --help says), row for row."""
    from mocli.schemes import SCHEMES
    from mocli.targets import REGISTRY, takes

    targets = _readme_table("| target | GPUs | kernels | linears | experts |")
    assert list(targets) == [t.value for t in REGISTRY]
    for t, layout in REGISTRY.items():
        assert targets[t.value][1:] == [layout.gpus, layout.kernels, takes(t, "linear"), takes(t, "moe")], t
    schemes = _readme_table("| scheme | what is stored |")
    assert schemes == {str(s): [f"`{s}`", s.summary] for s in SCHEMES}
