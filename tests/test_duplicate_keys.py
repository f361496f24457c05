"""JSON with a key twice in one object is refused wherever mocli reads a file it does not control (issue 43,
item 5): json keeps the later silently, so a MIXED_PRECISION layer named twice took the later scheme. The check
is cheap (colons in the raw text against keys parsed) and only parses again to name the key."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mocli.errors import CorruptFileError
from mocli.io.jsonfile import parse_json_bytes, two_level_keys
from mocli.io.safetensors_file import read_header


def _one_error_line(r) -> str:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "(hint:" in lines[0], r.stderr
    return lines[0]


def _append_member(path: Path, where: list[str], key: str, value) -> None:
    """Re-write ``path`` with ``key: value`` appended (as raw text) to the object at ``where``, which already
    holds ``key``: the only way to write a duplicate, json.dumps cannot."""
    data = json.loads(path.read_text())
    obj = data
    for k in where:
        obj = obj[k]
    assert key in obj
    marker = "__mocli_test_splice__"
    obj[marker] = None
    text = json.dumps(data, indent=2)
    before = text.count(json.dumps(key) + ":")
    text = text.replace(f'"{marker}": null', f"{json.dumps(key)}: {json.dumps(value)}")
    path.write_text(text)
    assert text.count(json.dumps(key) + ":") == before + 1


def test_a_layer_named_twice_in_quantized_layers_is_refused(cli, real_copy):
    d = real_copy("llama-mixed")
    layer = "model.layers.0.self_attn.q_proj"
    hq = json.loads((d / "hf_quant_config.json").read_text())
    first = hq["quantization"]["quantized_layers"][layer]
    other = {"quant_algo": "W4A16_NVFP4" if first["quant_algo"] != "W4A16_NVFP4" else "MXFP8", "group_size": 16}
    _append_member(d / "hf_quant_config.json", ["quantization", "quantized_layers"], layer, other)
    for cmd in (("validate", d), ("inspect", d), ("convert", d, "-o", d.parent / "o", "--target", "marlin")):
        line = _one_error_line(cli(*cmd))
        assert "hf_quant_config.json" in line and layer in line and "twice" in line
    assert not (d.parent / "o").exists()


def test_a_key_twice_in_config_json_is_refused(cli, real_copy):
    d = real_copy("llama-ct-fp8")
    _append_member(d / "config.json", ["quantization_config"], "format", "nvfp4-pack-quantized")
    line = _one_error_line(cli("validate", d))
    assert "config.json" in line and "'format'" in line and "twice" in line


def test_a_tensor_named_twice_in_an_index_is_refused(cli, real_copy):
    d = real_copy("qwen3_moe-nvfp4_kv-ct")
    index = d / "model.safetensors.index.json"
    name, shard = next(iter(json.loads(index.read_text())["weight_map"].items()))
    _append_member(index, ["weight_map"], name, shard)
    line = _one_error_line(cli("inspect", d))
    assert "model.safetensors.index.json" in line and name in line and "twice" in line


def _header_file(path: Path, header: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    return path


def test_a_tensor_named_twice_in_a_header_is_named(tmp_path):
    entry = '"a.weight": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}'
    f = _header_file(tmp_path / "m.safetensors", ("{" + entry + ", " + entry.replace("[0, 4]", "[4, 8]") + "}").encode())
    with pytest.raises(CorruptFileError, match=r"the key 'a\.weight' appears twice"):
        read_header(f)
    # a field twice inside one entry (which safetensors' own reader refuses) and a metadata key twice are caught too
    for raw in ('{"a.weight": {"dtype": "BF16", "dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}',
                '{"__metadata__": {"format": "pt", "format": "np"}, ' + entry + "}"):
        with pytest.raises(CorruptFileError, match="twice"):
            read_header(_header_file(tmp_path / "n.safetensors", raw.encode()))


def test_colons_inside_strings_are_not_duplicates(tmp_path):
    """The cheap count over-counts colons in strings; the slow path then finds no duplicate and the file reads."""
    raw = b'{"_name_or_path": "https://example.org/a:b", "x": {"y": "1:2:3"}, "l": [{"k": ":"}]}'
    assert parse_json_bytes(raw, tmp_path / "c.json") == json.loads(raw)
    assert parse_json_bytes(raw, tmp_path / "c.json", walk=False) == json.loads(raw)
    # the same key in two different objects is no duplicate
    raw = b'{"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 3}, {"k": 4}]}'
    assert parse_json_bytes(raw, tmp_path / "c.json", walk=False, keys=two_level_keys) == json.loads(raw)
    with pytest.raises(CorruptFileError, match="'k' appears twice"):
        parse_json_bytes(b'{"a": [{"k": 1, "k": 2}]}', tmp_path / "c.json", walk=False, keys=two_level_keys)


@pytest.mark.parametrize("raw", [b'{"a": NaN, "b": -Infinity}', b'{"big": [1e400, 18446744073709551616]}',
                                 b'\xef\xbb\xbf{"bom": 1}', '{"utf16": 1}'.encode("utf-16"),
                                 b'{"w": 1.0000000000000002, "n": -0, "s": "\\u00e9\\n"}'])
def test_what_the_fast_parser_refuses_reads_as_json_reads_it(tmp_path, raw):
    """JSON is parsed by orjson, and what it refuses (NaN and Infinity, numbers past 64 bits or float range, a
    byte-order mark, another encoding) by json: every input reads as json.loads reads it (NaN compared as
    its text)."""
    got = parse_json_bytes(raw, tmp_path / "c.json")
    assert repr(got) == repr(json.loads(raw))
    with pytest.raises(CorruptFileError, match="is not valid JSON"):
        parse_json_bytes(b'{"a": 1,}', tmp_path / "c.json")
