"""Shared fixtures: the real exports, generated checkpoints, and a CLI runner."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mocli.cli import app

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "fixtures" / "real"
REAL_LLAMA = REAL / "llama-fp8_kv"
REAL_QWEN = REAL / "qwen3_moe-nvfp4_kv"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
