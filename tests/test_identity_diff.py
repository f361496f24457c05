"""make identity's comparison (tests/bench/identity_diff.py) sees what it must: one changed tensor byte, a
changed non-version JSON field, a file only one side has; and lets through only the producer's version
and the digest another file keeps of a file that differs only so."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import save_file

from tests.bench.identity_diff import DIFFERS, IDENTICAL, VERSION_ONLY, compare_dirs, worst

VERSIONS = ("0.1.0", "0.2.0")


def _output(d, version="0.1.0", config_digest="aa", scale=2.0, extra=None):
    d.mkdir()
    save_file({"a.weight": torch.arange(8, dtype=torch.float32), "a.scale": torch.tensor(scale)},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"quantization_config": {"mocli": {"version": version, "x": 1}}}))
    layout = {"files": {"config.json": {"size": 10, "xxh3_128": config_digest},
                        "rank-0/model.safetensors": {"xxh3_128": "cc"}},
              "provenance": {"version": version, "source": {"path": "/src"}}}
    (d / "mocli-layout.json").write_text(json.dumps(layout | (extra or {})))
    return d


def _by_path(diffs):
    return {d.path: d for d in diffs}


def test_same_bytes_are_identical(tmp_path):
    a, b = _output(tmp_path / "a"), _output(tmp_path / "b")
    diffs = compare_dirs(a, b, VERSIONS)
    assert {d.status for d in diffs} == {IDENTICAL} and worst(diffs) == IDENTICAL
    assert sorted(d.path for d in diffs) == ["config.json", "mocli-layout.json", "model.safetensors"]


def test_version_and_the_digest_of_a_version_only_file_are_tolerated(tmp_path):
    a, b = _output(tmp_path / "a"), _output(tmp_path / "b", version="0.2.0", config_digest="bb")
    got = _by_path(compare_dirs(a, b, VERSIONS))
    assert got["config.json"].status == VERSION_ONLY
    assert got["config.json"].details == ["/quantization_config/mocli/version"]
    assert got["mocli-layout.json"].status == VERSION_ONLY
    assert set(got["mocli-layout.json"].details) == {"/files/config.json/xxh3_128", "/provenance/version"}
    assert got["model.safetensors"].status == IDENTICAL


def test_a_version_other_than_the_two_releases_differs(tmp_path):
    a, b = _output(tmp_path / "a"), _output(tmp_path / "b", version="9.9.9")
    got = _by_path(compare_dirs(a, b, VERSIONS))
    assert got["config.json"].status == DIFFERS
    # config.json differs for real, so the digest kept of it is no longer tolerated either
    assert got["mocli-layout.json"].status == DIFFERS


def test_the_digest_of_a_file_that_differs_is_a_difference(tmp_path):
    a = _output(tmp_path / "a")
    b = _output(tmp_path / "b", extra={"files": {"config.json": {"size": 10, "xxh3_128": "aa"},
                                                  "rank-0/model.safetensors": {"xxh3_128": "dd"}}})
    got = _by_path(compare_dirs(a, b, VERSIONS))
    assert got["mocli-layout.json"].status == DIFFERS
    assert got["mocli-layout.json"].details == ["/files/rank-0/model.safetensors/xxh3_128: 'cc' -> 'dd'"]


def test_one_tensor_byte_is_named(tmp_path):
    a, b = _output(tmp_path / "a"), _output(tmp_path / "b", scale=2.0000002)
    got = _by_path(compare_dirs(a, b, VERSIONS))
    assert got["model.safetensors"].status == DIFFERS
    assert got["model.safetensors"].details == ["a.scale: bytes differ"]


def test_another_field_a_missing_key_and_an_extra_file_differ(tmp_path):
    a, b = _output(tmp_path / "a"), _output(tmp_path / "b", extra={"target": "marlin"})
    shutil.copy(b / "config.json", b / "generation_config.json")
    got = _by_path(compare_dirs(a, b, VERSIONS))
    assert got["mocli-layout.json"].details == ["/target: '<absent>' -> 'marlin'"]
    assert got["generation_config.json"].status == DIFFERS and got["generation_config.json"].details == ["only in head"]
    assert worst(list(got.values())) == DIFFERS


def test_a_record_whose_digest_algorithm_changed_is_tolerated_a_lost_record_is_not(tmp_path):
    """8ca1961 records XXH3-128 where the base recorded BLAKE3: the same source and outputs, records that cannot
    be compared; one difference each, tolerated. A record that loses its digest with none in its place differs."""
    def records(algo: str, value: str) -> dict:
        return {"files": {"config.json": {"size": 10, algo: value}, "rank-0/model.safetensors": {algo: value}},
                "provenance": {"version": "0.1.0", "source": {"path": "/src"}, "source_shards": {"s": {algo: value}}}}

    a = _output(tmp_path / "a", extra=records("blake3", "aa"))
    b = _output(tmp_path / "b", extra=records("xxh3_128", "bb"))
    got = _by_path(compare_dirs(a, b, VERSIONS))
    assert got["mocli-layout.json"].status == VERSION_ONLY
    assert set(got["mocli-layout.json"].details) == {f"{p}/<digest algorithm>" for p in (
        "/files/config.json", "/files/rank-0/model.safetensors", "/provenance/source_shards/s")}
    lost = records("xxh3_128", "bb")
    del lost["provenance"]["source_shards"]["s"]["xxh3_128"]
    c = _output(tmp_path / "c", extra=lost)
    got = _by_path(compare_dirs(a, c, VERSIONS))
    assert got["mocli-layout.json"].status == DIFFERS
    assert got["mocli-layout.json"].details == ["/provenance/source_shards/s/blake3: 'aa' -> '<absent>'"]
