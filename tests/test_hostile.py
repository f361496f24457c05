"""Broken and hostile input: exit 0/1/2 only, one error line with a hint, never a traceback or exit 3."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.generate import make_checkpoint
from tests.conftest import PYTHONPATH, REAL_LLAMA, REAL_QWEN


def _header(path: Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n], raw[8 + n:]


def _write(path: Path, header: bytes, data: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _one_error_line(r, code: int = 2) -> str:
    assert r.exit_code == code, (r.exit_code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "(hint:" in lines[0], f"no hint: {lines[0]}"
    return lines[0]


@pytest.fixture
def single(tmp_path):
    return make_checkpoint(tmp_path / "m")


def _edit_header(d: Path, fn) -> None:
    f = d / "model.safetensors"
    header, data = _header(f)
    _write(f, fn(header), data)


def test_duplicate_tensor_name_in_one_header(cli, single):
    # json keeps the last of two equal keys; the safetensors library refuses the file.
    def dup(h: bytes) -> bytes:
        j = json.loads(h)
        name = "model.layers.0.self_attn.o_proj.weight_scale"
        entry = json.dumps({name: j[name]})[1:-1]
        return h.rstrip()[:-1] + b"," + entry.encode() + b"}"

    _edit_header(single, dup)
    line = _one_error_line(cli("validate", single))
    assert "model.layers.0.self_attn.o_proj.weight_scale" in line and "twice" in line


@pytest.mark.parametrize("kind", ["lone_surrogate", "invalid_utf8"])
def test_names_that_are_not_unicode(cli, single, kind):
    def bad(h: bytes) -> bytes:
        if kind == "lone_surrogate":
            return h.replace(b'"lm_head.weight"', b'"lm_head.\\ud800weight"')
        return h.replace(b'"lm_head.weight"', b'"lm_head.\xffweight"')

    _edit_header(single, bad)
    for cmd in ("inspect", "validate"):
        line = _one_error_line(cli(cmd, single))
        assert "model.safetensors" in line


@pytest.mark.parametrize("where", ["config.json", "hf_quant_config.json", "index", "header"])
def test_deeply_nested_json(cli, tmp_path, where):
    d = make_checkpoint(tmp_path / "m", shards=2)
    deep = "[" * 100_000 + "]" * 100_000
    if where == "index":
        (d / "model.safetensors.index.json").write_text('{"weight_map": ' + deep + "}")
    elif where == "header":
        f = next(d.glob("model-*.safetensors"))
        header, data = _header(f)
        _write(f, header.rstrip()[:-1] + b',"__x__": ' + deep.encode() + b"}", data)
    else:
        (d / where).write_text('{"quantization_config": ' + deep + "}")
    line = _one_error_line(cli("validate", d))
    assert "deep" in line or "nest" in line


def test_nesting_within_the_json_limit_is_still_refused(cli, single):
    # 200 levels parse fine with json, but anything walking them recursively could blow the stack.
    (single / "config.json").write_text('{"quantization_config": {"ignore": ' + "[" * 200 + "]" * 200 + "}}")
    assert "deeper than" in _one_error_line(cli("inspect", single))


@pytest.mark.parametrize("fault,expect", [
    ("unknown_dtype", "unknown dtype"),
    ("reversed_offsets", "reversed offsets"),
    ("float_shape", "malformed"),
])
def test_header_faults_have_hints(cli, single, fault, expect):
    def bad(h: bytes) -> bytes:
        j = json.loads(h)
        e = j["lm_head.weight"]
        if fault == "unknown_dtype":
            e["dtype"] = "F7"
        elif fault == "reversed_offsets":
            e["data_offsets"] = e["data_offsets"][::-1]
        else:
            e["shape"] = [float(x) for x in e["shape"]]
        return json.dumps(j).encode()

    _edit_header(single, bad)
    assert expect in _one_error_line(cli("inspect", single))


@pytest.mark.parametrize("weight_map", ['"x"', "[1, 2]", '{"a": 1}', "null"])
def test_index_weight_map_of_the_wrong_type(cli, tmp_path, weight_map):
    d = make_checkpoint(tmp_path / "m", shards=2)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + weight_map + "}")
    assert "weight_map" in _one_error_line(cli("inspect", d))


def test_symlink_loop(cli, tmp_path):
    d = make_checkpoint(tmp_path / "m")
    (d / "model.safetensors").unlink()
    os.symlink("model.safetensors", d / "model.safetensors")
    _one_error_line(cli("inspect", d))
    d2 = make_checkpoint(tmp_path / "s", shards=2)
    shard = next(d2.glob("model-*.safetensors"))
    shard.unlink()
    os.symlink(shard.name, shard)
    assert "link" in _one_error_line(cli("inspect", d2))


def test_sharded_repo_from_the_hf_cache(cli, tmp_path, monkeypatch):
    """Cache snapshots are symlinks into ../../blobs/: containment is judged on names, not targets."""
    import hashlib

    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", shards=3)
    repo = cache / "models--org--sharded"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    r = cli("--json", "validate", "org/sharded", env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.stderr
    r = cli("--json", "inspect", "org/sharded", env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0 and len(r.json["shards"]) == 3
    # huggingface_hub itself reads this as one cached repo whose snapshot files are its blobs
    info = huggingface_hub.scan_cache_dir(cache)
    (cached,) = info.repos
    assert cached.repo_id == "org/sharded" and not info.warnings
    (revision,) = cached.revisions
    assert {f.file_name for f in revision.files} == {f.name for f in src.iterdir()}
    assert all(f.file_path.is_symlink() and f.blob_path.parent == repo / "blobs" for f in revision.files)
    # convert follows the snapshot's links, and so does verify's byte check of the source (a regression:
    # the no-link rule of mocli's own outputs was applied to the source's shards)
    out = tmp_path / "out"
    r = cli("convert", "org/sharded", "-o", out, "-t", "flashinfer-cutlass", env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.stderr
    r = cli("--json", "verify", out, env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0 and r.json["ok"] and r.json["passthrough"]["checked"] > 0, r.stderr
    # a link inside the output is still refused
    shard = next(out.glob("model-*.safetensors"))
    moved = shard.rename(tmp_path / shard.name)
    os.symlink(moved, shard)
    r = cli("verify", out, env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 2 and "link" in r.stderr


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "a/../../x.safetensors", ""])
def test_index_entries_outside_the_directory(cli, tmp_path, entry):
    d = make_checkpoint(tmp_path / "m", shards=2)
    j = json.loads((d / "model.safetensors.index.json").read_text())
    j["weight_map"][next(iter(j["weight_map"]))] = entry
    (d / "model.safetensors.index.json").write_text(json.dumps(j))
    assert "outside" in _one_error_line(cli("inspect", d))


def test_same_exclude_entry_twice_is_not_a_disagreement(cli, tmp_path):
    d = make_checkpoint(tmp_path / "m")
    for name, key in (("hf_quant_config.json", None), ("config.json", "quantization_config")):
        j = json.loads((d / name).read_text())
        q = j["quantization"] if key is None else j[key]
        field = "exclude_modules" if key is None else "ignore"
        q[field] = q[field] + ["lm_head"] if key is None else ["lm_head"] + q[field][::-1]
        (d / name).write_text(json.dumps(j))
    r = cli("--json", "validate", d)
    assert r.exit_code == 0 and not [f for f in r.json["findings"] if f["code"] == "CFG004"], r.stdout


def test_quiet_and_verbose_after_the_command(cli, tmp_path):
    d = make_checkpoint(tmp_path / "m")
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP7"}}))
    assert "warning" in cli("inspect", d).stderr
    r = cli("inspect", d, "-q")
    assert r.exit_code == 0 and r.stderr == ""
    r = cli("validate", REAL_LLAMA, "-v")
    assert r.exit_code == 0 and "validate finished in" in r.stderr


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mocli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH}, **kw)


def test_closed_pipe_stops_quietly():
    """`mocli inspect M | head -1`: like other tools, stop with the SIGPIPE status and say nothing."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte: every write meets EPIPE, whatever the timing
    p = subprocess.Popen([sys.executable, "-m", "mocli", "inspect", str(REAL_QWEN)], stdout=w,
                         stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    os.close(w)
    err = p.stderr.read().decode()
    assert p.wait() == 141 and err == "", err


def test_no_numpy_warning_or_any_warning(tmp_path):
    p = _run("validate", str(REAL_LLAMA))
    assert p.returncode == 0 and p.stderr == "", p.stderr


# --- the sweep: random damage to headers and configs -------------------------------------------------

def _mutations(seed: int, d: Path) -> None:
    rnd = random.Random(seed)
    f = d / "model.safetensors"
    header, data = _header(f)
    kind = rnd.choice(["flip", "truncate_header", "json_type", "config_type", "length", "data_truncate"])
    if kind == "flip":
        h = bytearray(header)
        for _ in range(rnd.randint(1, 4)):
            h[rnd.randrange(len(h))] = rnd.randrange(256)
        _write(f, bytes(h), data)
    elif kind == "truncate_header":
        _write(f, header[: rnd.randrange(len(header))], data)
    elif kind == "json_type":
        j = json.loads(header)
        name = rnd.choice([k for k in j if k != "__metadata__"])
        field = rnd.choice(["dtype", "shape", "data_offsets"])
        j[name][field] = rnd.choice([None, 1.5, "x", [], {}, [[1]], True, -1, [1, 2, 3], 2**70])
        _write(f, json.dumps(j).encode(), data)
    elif kind == "config_type":
        name = rnd.choice(["config.json", "hf_quant_config.json"])
        j = json.loads((d / name).read_text())
        q = j.get("quantization") or j.get("quantization_config")
        key = rnd.choice(sorted(q))
        q[key] = rnd.choice([None, 1, "FP8", [], {}, [["a"]], {"a": {"b": []}}, True])
        (d / name).write_text(json.dumps(j))
    elif kind == "length":
        raw = f.read_bytes()
        f.write_bytes(struct.pack("<Q", rnd.choice([0, 1, 7, len(header) + 1, 2**63])) + raw[8:])
    else:
        f.write_bytes(f.read_bytes()[: 8 + len(header) + rnd.randrange(max(1, len(data)))])


@pytest.mark.parametrize("seed", range(int(os.environ.get("MOCLI_FUZZ_SEEDS", "40"))))
def test_fuzzed_inputs_never_crash(cli, tmp_path, seed):
    src = tmp_path / "m"
    shutil.copytree(REAL_LLAMA if seed % 2 else REAL_QWEN, src)
    _mutations(seed, src)
    for args in (["inspect", src], ["validate", src, "--target", "flashinfer-cutlass"],
                 ["convert", src, "-o", tmp_path / "out", "--target", "flashinfer-trtllm"]):
        r = cli(*args)
        assert r.exit_code in (0, 1, 2), (args[0], r.exit_code, r.stderr)
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
        if args[0] == "convert" and r.exit_code != 0:
            assert not (tmp_path / "out").exists()


# --- issue 43: a dtype the planner trusted, a scale that overflows for one target, a KV scale of many values.
# Each case is a fresh copy of a real export with one tensor edited (``edit_tensor``); a refusal is exit 1 with
# one line naming the tensor, and leaves neither OUT nor its partial directory.

def _fresh(tmp_path: Path, name: str, tensor: str, fn) -> Path:
    from tests.conftest import REAL, edit_tensor

    d = tmp_path / name
    shutil.copytree(REAL / name, d)
    edit_tensor(d, tensor, fn)
    return d


def _refused(cli, src: Path, out: Path, target: str, code: str, tensor: str) -> None:
    v = cli("--json", "validate", src, "--target", target)
    assert v.exit_code == 1, (v.stdout, v.stderr)
    assert any(f["code"] == code and tensor in f["location"] for f in v.json["findings"]), v.json["findings"]
    r = cli("convert", src, "-t", target, "-o", out)
    line = _one_error_line(r, 1)
    assert code in line and tensor in line, line
    assert not out.exists() and not (out.parent / f".{out.name}.mocli-partial").exists()


AWQ_PQS = "model.layers.0.self_attn.o_proj.pre_quant_scale"


def test_float32_pre_quant_scale_is_cast_to_bf16_as_the_engine_casts_it(cli, tmp_path):
    """vLLM-style loading (a BF16 parameter, ``copy_`` from whatever float the file holds) rounds a float32
    pre_quant_scale to nearest even: convert writes those BF16 values (it once wrote the float32 bytes over a
    BF16 slot: exit 3 and a partial left behind). Golden: torch's own cast."""
    import torch

    from tests.conftest import load_tensors

    nudged = {}

    def f32(t):  # values between two BF16 numbers, so the rounding is exercised (ties included)
        v = t.float() * (1 + 2.0 ** -9) + torch.linspace(0, 2.0 ** -12, t.numel())
        nudged["v"] = v
        return v

    src = _fresh(tmp_path, "llama-nvfp4_awq", AWQ_PQS, f32)
    assert cli("validate", src, "--target", "flashinfer-cutlass").exit_code == 0
    out = tmp_path / "o"
    r = cli("convert", src, "-t", "flashinfer-cutlass", "-o", out)
    assert r.exit_code == 0, r.stderr
    got = load_tensors(out)[AWQ_PQS]
    assert got.dtype == torch.bfloat16 and torch.equal(got, nudged["v"].to(torch.bfloat16))
    assert cli("verify", out).exit_code == 0


@pytest.mark.parametrize("fault,code", [("float64", "TNS002"), ("int32", "TNS002"), ("twice", "TNS003"),
                                        ("row", "TNS003")])
def test_pre_quant_scale_no_engine_reads_is_refused(cli, tmp_path, fault, code):
    import torch

    edits = {"float64": lambda t: t.double(), "int32": lambda t: t.float().round().int(),
             "twice": lambda t: torch.cat([t, t]), "row": lambda t: t.reshape(1, -1)}
    src = _fresh(tmp_path, "llama-nvfp4_awq", AWQ_PQS, edits[fault])
    _refused(cli, src, tmp_path / "o", "flashinfer-cutlass", code, AWQ_PQS)


W4A16_S2 = "model.layers.0.self_attn.o_proj.weight_scale_2"


def test_a_marlin_global_scale_that_overflows_is_refused_before_anything_is_written(cli, tmp_path):
    """weight_scale_2 = 1e4 is finite, but Marlin's global scale is weight_scale_2 * 2^119 / sf (SEMANTICS §13.5),
    which is no float32 for any power-of-two sf the fixture's block scales give (>= 2^8 * sf would be needed)."""
    src = _fresh(tmp_path, "llama-w4a16_nvfp4", W4A16_S2, lambda t: t.fill_(1e4))
    _refused(cli, src, tmp_path / "o", "marlin", "SCL006", W4A16_S2)
    line = cli("convert", src, "-t", "marlin", "-o", tmp_path / "o").stderr
    assert "weight_global_scale = inf" in line and "10000" in line
    # the other targets as before: they refuse W4A16 linears (TGT002) whatever the scale, SCL006 not among them
    for target in ("flashinfer-cutlass", "flashinfer-trtllm"):
        v = cli("--json", "validate", src, "--target", target)
        assert {f["code"] for f in v.json["findings"] if f["severity"] == "error"} == {"TGT002"}, v.json["findings"]


def test_an_nvfp4_scale_finite_for_flashinfer_but_not_for_marlin(cli, tmp_path):
    """The same 1e4 on an NVFP4 (W4A4) export: FlashInfer's alpha = input_scale * weight_scale_2 stays finite
    and converts; Marlin's global scale does not, and only marlin is refused."""
    src = _fresh(tmp_path, "llama-nvfp4_four_over_six", W4A16_S2, lambda t: t.fill_(1e4))
    for target in ("flashinfer-cutlass", "flashinfer-trtllm"):
        r = cli("convert", src, "-t", target, "-o", tmp_path / target)
        assert r.exit_code == 0, r.stderr
    _refused(cli, src, tmp_path / "o", "marlin", "SCL006", W4A16_S2)


def test_the_engine_refuses_a_computed_scale_validate_did_not_predict(cli, tmp_path, monkeypatch):
    """The write-time check behind the prediction, for every target and command: with validate's judgement
    of computed scales taken away, the engine meets the Inf as the unit writes it and refuses the same way."""
    import mocli.validate

    src = _fresh(tmp_path, "llama-w4a16_nvfp4", W4A16_S2, lambda t: t.fill_(1e4))
    monkeypatch.setattr(mocli.validate, "check_computed", lambda *a, **k: None)
    out = tmp_path / "o"
    line = _one_error_line(cli("convert", src, "-t", "marlin", "-o", out), 1)
    assert "SCL006" in line and "model.layers.0.self_attn.o_proj.weight_global_scale" in line and "inf" in line
    assert not out.exists() and not (tmp_path / ".o.mocli-partial").exists()


K_SCALE = "model.layers.0.self_attn.k_proj.k_scale"


@pytest.mark.parametrize("fault,code", [("two", "TNS003"), ("matrix", "TNS003"), ("int", "TNS002")])
def test_a_kv_scale_that_is_not_one_float_is_refused(cli, tmp_path, fault, code):
    import torch

    edits = {"two": lambda t: t.reshape(1).repeat(2), "matrix": lambda t: t.reshape(1, 1).repeat(2, 2),
             "int": lambda t: t.round().to(torch.int32)}
    src = _fresh(tmp_path, "llama-fp8_kv", K_SCALE, edits[fault])
    _refused(cli, src, tmp_path / "o", "flashinfer-cutlass", code, K_SCALE)


@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_kv_scale_of_one_value_converts(cli, tmp_path, shape):
    """() and [1]: what vLLM's KVCacheScaleParameter.weight_loader takes (numel() == 1)."""
    src = _fresh(tmp_path, "llama-fp8_kv", K_SCALE, lambda t: t.reshape(shape))
    assert cli("convert", src, "-t", "flashinfer-cutlass", "-o", tmp_path / "o").exit_code == 0


def test_a_float32_pre_quant_scale_beyond_bf16_is_refused(cli, tmp_path):
    """3.4e38 is a float32 and no BF16: the cast the engine does overflows (SCL006 before anything is written)."""
    def huge(t):
        v = t.float()
        v[3] = 3.4e38
        return v

    src = _fresh(tmp_path, "llama-nvfp4_awq", AWQ_PQS, huge)
    _refused(cli, src, tmp_path / "o", "flashinfer-cutlass", "SCL006", AWQ_PQS)
