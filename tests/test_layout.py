"""The manifest as one typed value (``mocli.formats.manifest.Layout``): read once with every field checked
(a wrong one is exit 2 naming its JSON path and the file), written from the same type (what convert
writes reads back to the same bytes), and layout_version 1 still read."""

from __future__ import annotations

import json
import shutil

import pytest

from mocli.formats.layout import MANIFEST_NAME, read_layout
from mocli.formats.manifest import manifest_json
from tests.conftest import REAL_QWEN, run_cli


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A real export converted once for tp 2 (ranks[]) with the trtllm target."""
    out = tmp_path_factory.mktemp("layout") / "o"
    r = run_cli("-q", "convert", REAL_QWEN, "-o", out, "--target", "flashinfer-trtllm", "--tp", "2")
    assert r.exit_code == 0, r.stderr
    return out


def _edited(converted, tmp_path, edit):
    out = tmp_path / "o"
    shutil.copytree(converted, out)
    m = json.loads((out / MANIFEST_NAME).read_text())
    edit(m)
    (out / MANIFEST_NAME).write_text(json.dumps(m, indent=2))
    return out


def _first_tensor(section):
    return next(iter(section["tensors"].values()))


# fault -> (the edit, what the one-line error must name: the field's JSON path and the wrong value)
FAULTS = {
    "unknown target": (lambda m: m.__setitem__("target", "tensorrt"), ["target 'tensorrt'"]),
    "unknown layout version": (lambda m: m.__setitem__("layout_version", 3), ["layout_version 3"]),
    "layout version a string": (lambda m: m.__setitem__("layout_version", "2"), ["layout_version '2'"]),
    "unknown kind": (lambda m: m["ranks"][1]["modules"][0].__setitem__("kind", "int3_linear"),
                     ["ranks[1].modules[0]", "kind 'int3_linear'"]),
    "shape of strings": (lambda m: _first_tensor(m["ranks"][0]).__setitem__("shape", ["64", 2]),
                         ["ranks[0].tensors.", "shape"]),
    "shape a number": (lambda m: _first_tensor(m).__setitem__("shape", 64), ["tensors.", "shape"]),
    "unknown dtype": (lambda m: _first_tensor(m).__setitem__("dtype", "F12"), ["tensors.", "dtype 'F12'"]),
    "rank entry in the wrong directory": (lambda m: m["ranks"][1].__setitem__("dir", "rank-0"),
                                          ["ranks[1]", "dir 'rank-0'"]),
    "parallel.ranks against ranks[]": (lambda m: m["ranks"].pop(), ["parallel.ranks is 2", "lists 1"]),
    "meta.experts a string": (lambda m: next(x for x in m["ranks"][0]["modules"] if "experts" in x["meta"])[
        "meta"].__setitem__("experts", "8"), ["ranks[0].modules[", "meta.experts"]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_wrong_field_is_exit_2_naming_it_and_the_file(converted, tmp_path, fault):
    from mocli.errors import MocliError

    edit, names = FAULTS[fault]
    out = _edited(converted, tmp_path, edit)
    for args in (["verify", out], ["verify", out, "--rank", "1"]):
        r = run_cli(*args)
        line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
        assert str(out / MANIFEST_NAME) in line and all(n in line for n in names), line
    with pytest.raises(MocliError) as e:  # the loader reads it through the same Layout
        read_layout(out)
    assert e.value.exit_code == 2 and all(n in e.value.message for n in names), e.value.message


def test_what_convert_writes_reads_back_to_the_same_bytes(converted):
    """The writer and the reader share one type: a written manifest, read into a Layout and serialised
    again, is the file byte for byte (every field in its place, in its order)."""
    from mocli.formats import write_json

    layout = read_layout(converted)
    assert layout.version == 2 and str(layout.target) == "flashinfer-trtllm"
    assert (layout.parallel.tp, layout.parallel.ep, layout.parallel.ranks) == (2, 1, 2)
    assert [r.dir for r in layout.ranks] == ["rank-0", "rank-1"] and layout.rank_ids == [0, 1]
    copy = converted.parent / "again.json"
    write_json(copy, manifest_json(layout))
    assert copy.read_bytes() == (converted / MANIFEST_NAME).read_bytes()


def test_the_layout_is_frozen(converted):
    import dataclasses

    layout = read_layout(converted)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.target = "marlin"
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.ranks[0].modules[0].kind = "nvfp4_linear"


def test_layout_version_1_is_still_read(converted, tmp_path):
    """A manifest the previous layout version wrote reads; verify then reports (exit 1, not 2) that vLLM
    would load such a directory as a ModelOpt export (``layout_audit.V1_REFUSAL``)."""
    out = _edited(converted, tmp_path, lambda m: m.__setitem__("layout_version", 1))
    assert read_layout(out).version == 1
    r = run_cli("verify", out, "--json", "--layers", "*.0.mlp.experts")
    assert r.exit_code == 1, r.stderr
    assert any("layout_version 1" in p for p in json.loads(r.stdout)["layout"]["problems"])
