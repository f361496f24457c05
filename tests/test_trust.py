"""Trust nothing in an OUT directory (LAYOUT.md "Trust model"): verify, the loader and resume stay inside
it, see all of it, and never hang — tried as an attacker and as an unlucky user would."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from fixtures.generate import make_checkpoint
from tests.conftest import PYTHONPATH, REAL_QWEN, digest_tree, interrupt_after, run_killed

CUTLASS = "flashinfer-cutlass"


def _convert(cli, src, out, *args):
    r = cli("-q", "convert", src, "-o", out, "--target", CUTLASS, *args)
    assert r.exit_code == 0, r.stderr
    return out


def _manifest(out):
    return json.loads((out / "mocli-layout.json").read_text())


def _write_manifest(out, m, redigest=True):
    """Rewrite the manifest; with ``redigest`` the attacker also recomputes every file's digest."""
    if redigest:
        for rel, info in m["files"].items():
            if (out / rel).is_file():
                data = (out / rel).read_bytes()
                info.clear()
                info.update(size=len(data), xxh3_128=xxhash.xxh3_128(data).hexdigest())
    (out / "mocli-layout.json").write_text(json.dumps(m))


def _verify(cli, out, *args):
    return cli("--json", "verify", out, "--device", "cpu", *args)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    return make_checkpoint(base / "src", arch="qwen3_moe", algo="NVFP4")


# --- reads and writes outside the given directories ---------------------------------------------------

def test_resume_never_writes_through_a_link_in_the_partial(cli, tmp_path, moe, monkeypatch):
    interrupt_after(monkeypatch, 20)
    assert cli("convert", moe, "-o", tmp_path / "o", "--target", CUTLASS).exit_code == 130
    monkeypatch.undo()
    partial = tmp_path / ".o.mocli-partial"
    shard = next(partial.glob("model-*.safetensors"))
    victim = tmp_path / "victim.bin"
    victim.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(victim)
    before = victim.read_bytes()
    r = cli("convert", moe, "-o", tmp_path / "o", "--target", CUTLASS)
    assert r.exit_code == 2 and shard.name in r.stderr and "symbolic link" in r.stderr
    assert victim.read_bytes() == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["../..", "/tmp", "rank-0"])
def test_rank_directory_must_be_its_own(cli, tmp_path, moe, where):
    from mocli.errors import InputError
    from mocli.loader import load_converted

    out = _convert(cli, moe, tmp_path / "o", "--tp", "2")
    m = _manifest(out)
    m["ranks"][1]["dir"] = where
    _write_manifest(out, m)
    r = _verify(cli, out)
    assert r.exit_code == 2 and "ranks[1]" in r.stderr and "rank-1" in r.stderr
    with pytest.raises(InputError):
        load_converted(out, rank=1)


@pytest.mark.parametrize("entry", ["/etc/hostname", "../outside.safetensors", "rank-0/../../x", ".hidden"])
def test_files_entries_stay_inside(cli, tmp_path, moe, entry):
    out = _convert(cli, moe, tmp_path / "o")
    m = _manifest(out)
    m["files"][entry] = {"size": 1, "sha256": "0" * 64}
    _write_manifest(out, m, redigest=False)
    r = _verify(cli, out)
    assert r.exit_code == 2 and repr(entry) in r.stderr, r.stderr


# --- verify certifies only what is there, and all of it --------------------------------------------

def _drop(out, names: set[str]) -> None:
    """Remove tensors from the shards and the index (an attacker who also fixes the digests)."""
    for f in sorted(out.rglob("model-*.safetensors")):
        t = load_file(str(f))
        if set(t) & names:
            save_file({k: v for k, v in t.items() if k not in names}, str(f), metadata={"format": "pt"})
    for idx in out.rglob("model.safetensors.index.json"):
        j = json.loads(idx.read_text())
        j["weight_map"] = {k: v for k, v in j["weight_map"].items() if k not in names}
        idx.write_text(json.dumps(j))


def test_a_removed_moe_layer_fails(cli, tmp_path, moe):
    out = _convert(cli, moe, tmp_path / "o")
    m = _manifest(out)
    layer = "model.layers.1.mlp.experts"
    gone = {n for n in m["tensors"] if n.startswith(layer + ".")}
    m["modules"] = [x for x in m["modules"] if x["name"] != layer]
    m["tensors"] = {k: v for k, v in m["tensors"].items() if k not in gone}
    _drop(out, gone)
    _write_manifest(out, m)
    r = _verify(cli, out)
    assert r.exit_code == 1
    assert any(p["module"] == layer and "missing" in p["problem"] for p in r.json["completeness"]["problems"])


def test_removed_lm_head_and_norm_fail(cli, tmp_path, moe):
    out = _convert(cli, moe, tmp_path / "o")
    m = _manifest(out)
    gone = {"lm_head.weight", "model.norm.weight"}
    m["tensors"] = {k: v for k, v in m["tensors"].items() if k not in gone}
    _drop(out, gone)
    _write_manifest(out, m)
    r = _verify(cli, out)
    assert r.exit_code == 1
    named = {p["module"] for p in r.json["completeness"]["problems"]}
    assert gone <= named


def test_a_deleted_rank_fails_naming_it(cli, tmp_path, moe):
    out = _convert(cli, moe, tmp_path / "o", "--tp", "2", "--ep", "2")
    shutil.rmtree(out / "rank-1")
    r = _verify(cli, out)
    assert r.exit_code == 1
    assert any(p["file"] == "rank-1" for p in r.json["files"]["problems"])


def test_a_rank_claiming_anothers_experts_fails(cli, tmp_path, moe):
    out = _convert(cli, moe, tmp_path / "o", "--tp", "2", "--ep", "2")
    m = _manifest(out)
    # rank 1 claims experts 0-1 (rank 0's) and its bytes are made rank 0's: every byte checks out
    for mod in m["ranks"][1]["modules"]:
        if mod["name"].endswith("mlp.experts"):
            mod["meta"]["expert_offset"] = 0
    for f0, f1 in zip(sorted((out / "rank-0").glob("model-*.safetensors")),
                      sorted((out / "rank-1").glob("model-*.safetensors")), strict=True):
        shutil.copy(f0, f1)
    m["ranks"][1]["tensors"] = m["ranks"][0]["tensors"]
    _write_manifest(out, m)
    r = _verify(cli, out)
    assert r.exit_code == 1
    assert any("expert_offset" in p["problem"] for p in r.json["completeness"]["problems"])


def test_checked_against_another_source_fails(cli, tmp_path):
    plain = make_checkpoint(tmp_path / "plain", arch="qwen3_moe", algo="NVFP4", kv_cache=False)
    with_kv = make_checkpoint(tmp_path / "kv", arch="qwen3_moe", algo="NVFP4", kv_cache=True)
    out = _convert(cli, plain, tmp_path / "o")
    m = _manifest(out)  # the provenance is rewritten to the other export, digests and all
    m["provenance"]["source"] = {"path": str(with_kv)}
    m["provenance"]["source_shards"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                        for p in with_kv.glob("*.safetensors")}
    _write_manifest(out, m)
    r = _verify(cli, out)
    assert r.exit_code == 1
    missing = {p["module"] for p in r.json["completeness"]["problems"]}
    assert "model.layers.0.self_attn.k_proj.k_scale" in missing


def test_index_pointing_at_a_second_copy_is_refused(cli, tmp_path, moe):
    out = _convert(cli, moe, tmp_path / "o")
    shard = next(out.glob("model-*.safetensors"))
    name = "model.norm.weight"
    bad = load_file(str(shard))[name].clone()
    bad.view(torch.uint8)[0] ^= 0xFF
    save_file({name: bad}, str(out / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    idx["weight_map"][name] = "model-00002-of-00002.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = _verify(cli, out)
    assert r.exit_code == 2 and name in r.stderr  # the tensor is in two shards: neither copy is trusted
    r = cli("--json", "inspect", out)
    assert r.exit_code == 2


@pytest.mark.parametrize("edit", ["config.json", "model.safetensors.index.json", "added file"])
def test_edits_to_configs_index_or_extra_files_are_seen(cli, tmp_path, moe, edit):
    out = _convert(cli, moe, tmp_path / "o")
    if edit == "added file":
        (out / "extra.safetensors").write_bytes(b"x")
    else:
        data = json.loads((out / edit).read_text())
        data["edited"] = True
        (out / edit).write_text(json.dumps(data))
    r = _verify(cli, out)
    assert r.exit_code == 1
    assert r.json["files"]["problems"], r.json["files"]


# --- resume -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_source_changed_between_kill_and_resume_starts_over(tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", shards=2)
    out = tmp_path / "o"
    args = ["-q", "convert", str(src), "-o", str(out), "--target", CUTLASS]
    assert run_killed(args, after=25).returncode == -9
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one data byte (a BF16 norm's mantissa): headers and sizes unchanged
    shard.write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    p = subprocess.run([sys.executable, "-m", "mocli", "--json", *args[1:]], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["resumed_units"] == 0
    p = subprocess.run([sys.executable, "-m", "mocli", *args[:2], str(src), "-o", str(tmp_path / "clean"),
                        "--target", CUTLASS], env=env)
    assert p.returncode == 0 and digest_tree(out) == digest_tree(tmp_path / "clean")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(argsets: list[list[str]], kill_rank: int | None = None, after: int = 0) -> list:
    """Two real processes of one torch.distributed world (what torchrun starts), each with its own
    arguments; ``kill_rank`` SIGKILLs itself at its ``after + 1``-th shard write."""
    from tests.conftest import _KILLER

    port = _free_port()
    procs = []
    for rank, args in enumerate(argsets):
        env = {**os.environ, "PYTHONPATH": PYTHONPATH, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "KILL_AFTER": str(after if rank == kill_rank else 10**9)}
        procs.append(subprocess.Popen([sys.executable, "-c", _KILLER, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]


@pytest.mark.slow
def test_one_process_finishes_a_torchrun_partial_with_right_digests(cli, tmp_path):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4")
    out = tmp_path / "o"
    args = ["-q", "convert", str(src), "-o", str(out), "--target", CUTLASS, "--tp", "2", "--max-shard-size", "200KB"]
    results = _two_processes([args, args], kill_rank=1, after=12)
    assert any(rc != 0 for rc, _, _ in results) and not out.exists()
    r = cli("--json", "convert", src, "-o", out, "--target", CUTLASS, "--tp", "2", "--max-shard-size", "200KB")
    assert r.exit_code == 0 and r.json["resumed_units"] > 0
    assert _verify(cli, out).exit_code == 0
    _convert(cli, src, tmp_path / "clean", "--tp", "2", "--max-shard-size", "200KB")
    assert digest_tree(out) == digest_tree(tmp_path / "clean")


@pytest.mark.slow
@pytest.mark.parametrize("differ", ["--tp", "-o"])
def test_torchrun_processes_with_different_arguments_refuse_before_writing(tmp_path, differ):
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4")
    base = ["convert", str(src), "--target", CUTLASS]
    a = base + ["-o", str(tmp_path / "o"), "--tp", "2"]
    b = base + (["-o", str(tmp_path / "o"), "--tp", "1"] if differ == "--tp" else ["-o", str(tmp_path / "p"), "--tp", "2"])
    results = _two_processes([a, b])
    for rc, _, err in results:
        assert rc == 2 and "disagree" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# --- hangs and crashes ---------------------------------------------------------------------------------

def _fifo_case(cli, tmp_path, moe, where: str):
    out = _convert(cli, moe, tmp_path / "o")
    shard = next(out.glob("model-*.safetensors"))
    if where == "shard":
        shard.unlink()
        os.mkfifo(shard)
    else:
        os.mkfifo(out / "pipe")
        m = _manifest(out)
        m["files"]["pipe"] = {"size": 0, "sha256": "0" * 64}
        _write_manifest(out, m, redigest=False)
    return out


@pytest.mark.parametrize("where", ["shard", "files entry"])
def test_a_fifo_is_an_error_not_a_hang(tmp_path, moe, where):
    from tests.conftest import run_cli

    out = _fifo_case(run_cli, tmp_path, moe, where)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    p = subprocess.run([sys.executable, "-m", "mocli", "verify", str(out), "--device", "cpu"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (1, 2) and "Traceback" not in p.stderr
    assert "FIFO" in p.stderr + p.stdout
    code = f"from mocli.loader import load_converted\nload_converted({str(out)!r})"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if where == "shard":
        assert p.returncode != 0 and "FIFO" in p.stderr


MANIFEST_FAULTS = {
    "parallel.tp a string": lambda m: m["parallel"].__setitem__("tp", "1"),
    "modules not a list": lambda m: m.__setitem__("modules", {"a": 1}),
    "a module is a number": lambda m: m["modules"].__setitem__(0, 3),
    "unknown kind": lambda m: m["modules"][0].__setitem__("kind", "int3_linear"),
    "meta.experts a string": lambda m: next(x for x in m["modules"] if "experts" in x["meta"])["meta"].__setitem__(
        "experts", "8"),
    "tensor shape of strings": lambda m: next(iter(m["tensors"].values())).__setitem__("shape", ["a"]),
    "files entry a number": lambda m: m["files"].__setitem__(next(iter(m["files"])), 1),
    "ranks on a one-rank output": lambda m: m.__setitem__("ranks", [1, 2]),
    "provenance a list": lambda m: m.__setitem__("provenance", []),
}


@pytest.mark.parametrize("fault", sorted(MANIFEST_FAULTS))
def test_wrong_types_in_the_manifest_are_exit_2(cli, tmp_path, moe, fault):
    from mocli.errors import InputError
    from mocli.loader import load_converted

    out = _convert(cli, moe, tmp_path / "o")
    m = _manifest(out)
    MANIFEST_FAULTS[fault](m)
    _write_manifest(out, m, redigest=False)
    r = _verify(cli, out)
    assert r.exit_code == 2 and "internal error" not in r.stderr, r.stderr
    with pytest.raises(InputError):
        load_converted(out)


@pytest.mark.slow
def test_more_shards_than_open_files_allowed(tmp_path):
    """1,000+ shard checkpoints exist: validate --deep and convert open one shard at a time."""
    src = make_checkpoint(tmp_path / "src", arch="qwen3_moe", algo="NVFP4", shards=200)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))\n"
            "from mocli.cli import main; main(sys.argv[1:])")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 40
    for args in (["validate", str(src), "--deep"],
                 ["-q", "convert", str(src), "-o", str(tmp_path / "o"), "--target", CUTLASS]):
        p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr


def test_real_export_output_verifies(cli, tmp_path):
    out = _convert(cli, REAL_QWEN, tmp_path / "o")
    r = _verify(cli, out)
    assert r.exit_code == 0 and r.json["completeness"]["problems"] == []


@pytest.mark.parametrize("resumed", [False, True])
def test_an_internal_error_leaves_nothing_behind(cli, tmp_path, monkeypatch, resumed):
    """A mocli bug in a unit (exit 3): the partial directory is removed, the message says so, and nothing at
    OUT; also where the run had resumed an interrupted one's partial (a resume would meet the same bug)."""
    import mocli.ops.nvfp4

    out = tmp_path / "o"
    partial = tmp_path / ".o.mocli-partial"
    (tmp_path / "notes.txt").write_text("mine")
    if resumed:
        restore = interrupt_after(monkeypatch, 2)
        assert cli("convert", REAL_QWEN, "-o", out, "--target", CUTLASS).exit_code == 130 and partial.is_dir()
        restore()

    def bug(*a, **k):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(mocli.ops.nvfp4, "swizzle_block_scales", bug)
    r = cli("convert", REAL_QWEN, "-o", out, "--target", CUTLASS)
    assert r.exit_code == 3 and "internal error: RuntimeError: planted bug" in r.stderr, r.stderr
    assert "nothing was kept" in r.stderr and str(partial) in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() and not partial.exists()
    # what mocli did not create is left alone (the lock file went with the run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"
