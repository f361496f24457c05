"""Shared fixtures: the real exports, generated checkpoints, and a CLI runner."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mocli.cli import app

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "fixtures" / "real"
# for child processes: this checkout first, then whatever the caller had on the path (dependencies
# installed outside the environment, as on the GPU machines)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
REAL_LLAMA = REAL / "llama-fp8_kv"
REAL_QWEN = REAL / "qwen3_moe-nvfp4_kv"


def digest_tree(d: Path) -> dict[str, str]:
    """SHA-256 of every file under ``d``, by relative path: byte identity of two outputs."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def load_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard in ``d``, read by the safetensors library (not mocli's reader)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def edit_tensor(d: Path, name: str, fn) -> None:
    """Replace tensor ``name`` wherever it is stored under ``d`` (any rank's shard) by ``fn`` of a copy: a
    planted fault, written with the safetensors library."""
    from safetensors.torch import load_file, save_file

    for f in sorted(d.rglob("*.safetensors")):
        t = load_file(str(f))
        if name in t:
            t[name] = fn(t[name].clone()).contiguous()
            save_file(t, str(f), metadata={"format": "pt"})
            return
    raise KeyError(name)


def u8(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat."""
    return t.contiguous().reshape(-1).view(torch.uint8)


_KILLER = """
import os, signal, sys
from mocli.io.shard_writer import ShardWriter
real, n = ShardWriter.write, [0]
def write(self, *a, **k):
    n[0] += 1
    if n[0] > int(os.environ["KILL_AFTER"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
ShardWriter.write = write
from mocli.cli import main
main(sys.argv[1:])
"""


def interrupt_after(monkeypatch, calls: int, method: str = "write"):
    """Ctrl-C (KeyboardInterrupt) at the ``calls + 1``-th ``ShardWriter.<method>`` call in this process
    (``write``: bytes from memory; ``copy``: verbatim source ranges). Returns the function that puts
    the method back (for the resumed run), leaving the test's other patches in place."""
    from mocli.io.shard_writer import ShardWriter

    real, n = getattr(ShardWriter, method), {"n": 0}

    def wrapped(self, *a, **k):
        n["n"] += 1
        if n["n"] > calls:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(ShardWriter, method, wrapped)
    return lambda: monkeypatch.setattr(ShardWriter, method, real)


def run_killed(args: list[str], after: int) -> subprocess.CompletedProcess:
    """``mocli ARGS`` in a real process that SIGKILLs itself at its ``after + 1``-th shard write."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "KILL_AFTER": str(after)}
    return subprocess.run([sys.executable, "-c", _KILLER, *args], env=env, capture_output=True)


def pytest_collection_modifyitems(config, items):
    import importlib.util

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    if importlib.util.find_spec("vllm") is None:
        skips["vllm"] = pytest.mark.skip(reason="needs vLLM's CPU build (make install-vllm; make test-vllm)")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def map_every_input(monkeypatch):
    """CPU units map their large inputs instead of reading them (``UnitContext.rows``, from
    ``MAP_MIN`` bytes). The fixtures' tensors are all small: here every input is mapped, the path a
    real checkpoint's weights take. The read path is checked against it in test_convert."""
    monkeypatch.setattr("mocli.stream.pool.MAP_MIN", 1)


@pytest.fixture(autouse=True)
def splice_every_write(monkeypatch):
    """Writes of ``mocli.io.splice.MIN_BYTES`` and more go through vmsplice and splice, the rest through
    pwrite. The fixtures' tensors are all small: here every write in process takes the splice path, the
    one a real checkpoint's tensors take (test_splice checks it against pwrite)."""
    monkeypatch.setattr("mocli.io.splice.MIN_BYTES", 1)


@pytest.fixture(params=["c", "numpy"])
def byte_moves(request, monkeypatch):
    """Marlin's NVFP4 weight repack and its inverse both ways: in C (``mocli.ops.marlin_native``,
    ``mocli.targets.marlin_decode.NATIVE``; skipped where no compiler built them, and test_marlin_native
    fails where one would have) and in numpy, the path without them."""
    from mocli.ops import marlin_native
    from mocli.targets import marlin_decode

    if request.param == "numpy":
        monkeypatch.setattr(marlin_native, "OK", False)
        monkeypatch.setattr(marlin_decode, "NATIVE", False)
        # and in process: worker processes (8+ cores) may have been forked with the C moves on
        monkeypatch.setattr("mocli.workers.for_bytes", lambda total, group: None)
    elif not (marlin_native.OK and marlin_decode.NATIVE):
        pytest.skip("the C byte moves are not built here (no C compiler at install)")
    return request.param


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def json(self):
        return json.loads(self.stdout)


def run_cli(*args: str, env: dict | None = None) -> Result:
    """Invoke the real Typer app; stdout and stderr kept apart."""
    r = CliRunner().invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def real_copy(tmp_path):
    """A writable copy of a real export (tests never touch fixtures/ in place)."""

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(REAL / name, dst)
        return dst

    return copy
