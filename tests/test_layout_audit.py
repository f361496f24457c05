"""A converted directory whose records lie about it fails verify, with the lie named (tests/layout_damage.py).

The same damaged directories are refused by mocli's vLLM plugin in tests/test_vllm.py, so a CI gate on
``mocli verify`` never passes a directory that the engine refuses."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import REAL_LLAMA, REAL_QWEN
from tests.layout_damage import DAMAGES

SOURCES = {"llama-fp8": REAL_LLAMA, "qwen3moe-nvfp4": REAL_QWEN}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    made = {}

    def get(source: str, target: str):
        key = (source, target)
        if key not in made:
            from tests.conftest import run_cli

            out = tmp_path_factory.mktemp("audit") / f"{source}.{target}"
            r = run_cli("convert", SOURCES[source], "-o", out, "--target", target)
            assert r.exit_code == 0, r.stderr
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_verify_fails_a_directory_that_lies(cli, converted, tmp_path, damage):
    d = DAMAGES[damage]
    out = tmp_path / "out"
    shutil.copytree(converted(d.source, d.target), out)
    r = cli("verify", out)
    assert r.exit_code == 0, r.stderr  # the copy itself is sound
    d.edit(out)
    r = cli("--json", "verify", out)
    assert r.exit_code == d.exit_code, (r.exit_code, r.stdout[-2000:], r.stderr[-2000:])
    if d.exit_code == 2:
        assert d.says in r.json["error"]["message"]
    else:
        found = r.json["layout"]["problems"]
        assert any(d.says in p for p in found), found


def test_relabelled_moe_is_told_by_its_roles(cli, converted, tmp_path):
    """An NVFP4 MoE layer's shapes are the same in both FlashInfer layouts; its roles are not (trtllm's
    kernel takes three more scale vectors), so the relabelled layer is named even without the dense ones."""
    out = tmp_path / "out"
    shutil.copytree(converted("qwen3moe-nvfp4", "flashinfer-cutlass"), out)
    DAMAGES["relabelled-target"].edit(out)
    r = cli("--json", "verify", out)
    assert r.exit_code == 1
    assert "model.layers.0.mlp.experts: a nvfp4_moe module of flashinfer-trtllm holds {" in "\n".join(
        r.json["layout"]["problems"]), r.json["layout"]
