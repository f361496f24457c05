"""Work done aside in a forked child (``mocli.io.aside``): half a sharded checkpoint's headers, validate's
judgement of a target's computed scales, its scale checks where no target is asked. The child's answer must be exactly what this process would have
found, and every fault must be raised as a serial run raises it. The goldens here are the serial path's
(``_checked_entries`` one tensor at a time, ``check_computed`` in this process), forced by turning the fork off.

pytest's process has torch loaded, where mocli never forks on its own (``aside._worth_it``): each test forces
the fork and counts it, so none of them can pass by taking the serial path."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mocli.io.aside as aside
import mocli.io.header as header
from mocli.errors import CorruptFileError, MocliError
from mocli.formats.index import read_index
from tests.conftest import REAL, edit_tensor

SHARDS = 9  # >= header.ASIDE_SHARDS: the child reads shards 1, 3, 5, 7


@pytest.fixture
def forks(monkeypatch):
    """Force the fork where mocli would fork on a quiet 2-core machine; count the children."""
    made = []
    fork = aside._fork

    def counted(work):
        job = fork(work)
        made.append(job)
        return job

    monkeypatch.setattr(aside, "_worth_it", lambda: True)
    monkeypatch.setattr(aside, "_fork", counted)
    return made


def serial(monkeypatch, fn, *args):
    """``fn(*args)`` with nothing forked: its value, or the error it raised as (type, message)."""
    with monkeypatch.context() as m:
        m.setattr(aside, "_worth_it", lambda: False)
        try:
            return fn(*args)
        except MocliError as e:
            return type(e), str(e)


def _shard(path: Path, tensors: dict[str, tuple[str, list[int], int]], junk: dict | None = None) -> None:
    """A safetensors file written by hand: name -> (dtype, shape, bytes per element), laid end to end;
    ``junk`` overrides header entries (a planted fault)."""
    head, off = {"__metadata__": {"format": "pt", "shard": path.name}}, 0
    for name, (dtype, shape, width) in tensors.items():
        n = width
        for d in shape:
            n *= d
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    head.update(junk or {})
    raw = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * (off // 256) + bytes(off % 256))


def _checkpoint(root: Path) -> Path:
    root.mkdir()
    weight_map = {}
    for s in range(SHARDS):
        fname = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {f"model.layers.{s}.mlp.{p}.{t}": spec for p in ("gate_proj", "up_proj", "down_proj")
                   for t, spec in (("weight", ("U8", [8, 4 + s], 1)), ("weight_scale", ("F8_E4M3", [8, 1], 1)),
                                   ("weight_scale_2", ("F32", [], 4)), ("bias", ("BF16", [8], 2)))}
        tensors[f"model.layers.{s}.empty"] = ("F16", [0, 3], 2)
        _shard(root / fname, tensors)
        weight_map |= dict.fromkeys(tensors, fname)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def _spoil(root: Path, shard: int, junk: dict) -> None:
    path = sorted(root.glob("*.safetensors"))[shard]
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n]) | junk
    new = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_headers_read_aside_are_the_headers_read_here(tmp_path, monkeypatch, forks):
    root = _checkpoint(tmp_path / "ck")
    got = read_index(root)
    assert len(forks) == 1 and forks[0] is not None
    want = serial(monkeypatch, read_index, root)
    assert got == want  # every header (path, size, offsets, entries, metadata, digest) and every entry
    assert len(got[1]) == SHARDS * 13
    assert [h.metadata["shard"] for h in got[0]] == [p.name for p in sorted(root.glob("*.safetensors"))]


# a fault the child meets in shard 3 must be raised by this process, as a serial read names it, and before
# one in shard 4 (this process's own); a fault only in this process's shards as well
@pytest.mark.parametrize("spoiled", [(3,), (4,), (3, 4), (1, 8)])
@pytest.mark.parametrize("junk", [{"x": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}},
                                  {"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}},  # overlaps
                                  {"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 10 ** 9]}},
                                  {"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}},
                                  {"x": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}}])
def test_a_faulty_shard_is_named_as_a_serial_read_names_it(tmp_path, monkeypatch, forks, spoiled, junk):
    root = _checkpoint(tmp_path / "ck")
    for s in spoiled:
        _spoil(root, s, junk)
    with pytest.raises(CorruptFileError) as e:
        read_index(root)
    assert len(forks) == 1
    assert (type(e.value), str(e.value)) == serial(monkeypatch, read_index, root)
    assert sorted(root.glob("*.safetensors"))[spoiled[0]].name in str(e.value)


def test_a_child_that_fails_leaves_the_work_to_this_process(tmp_path, monkeypatch, forks):
    root = _checkpoint(tmp_path / "ck")

    def broken(*a):
        raise RuntimeError("only the child runs this")

    monkeypatch.setattr(header, "_columns_or_none", broken)
    got = read_index(root)
    assert len(forks) == 1
    assert got == serial(monkeypatch, read_index, root)


_DTYPES = st.sampled_from(["U8", "F32", "BF16", "F8_E4M3", "I64", "F7", 3, None])
_DIM = st.one_of(st.integers(0, 4), st.integers(-2, -1), st.just(True), st.just(2.0))


@st.composite
def _headers(draw):
    """Headers that are mostly well formed (so both readers accept them), with faults drawn in."""
    names = draw(st.lists(st.text("abc.", min_size=1, max_size=4), min_size=0, max_size=6, unique=True))
    out, off = {}, 0
    for name in names:
        dtype = draw(st.sampled_from(["U8", "F32", "BF16"])) if draw(st.booleans()) else draw(_DTYPES)
        shape = draw(st.lists(st.integers(0, 4), max_size=3)) if draw(st.booleans()) else draw(st.lists(_DIM, max_size=3))
        width = header.DTYPE_SIZES.get(dtype, 1) if isinstance(dtype, str) else 1
        n = width
        for d in shape:
            n *= d if isinstance(d, int) else 1
        begin = off + draw(st.sampled_from([0, 0, 0, -1, 1, -3]))
        end = begin + (n if draw(st.integers(0, 5)) else draw(st.integers(-2, 3)))
        info = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        mangle = draw(st.integers(0, 12))
        if mangle == 1:
            del info["dtype"]
        elif mangle == 2:
            info["data_offsets"] = [begin]
        elif mangle == 3:
            info["shape"] = "abc"
        elif mangle == 4:
            info["data_offsets"] = [float(begin), end]
        elif mangle == 5:
            info = [dtype]
        out[name] = info
        off = max(off, end if isinstance(end, int) else off)
    return out, draw(st.integers(0, off + 2))


@settings(max_examples=400, deadline=None)
@given(_headers())
def test_the_column_check_is_never_looser_than_the_check_one_by_one(case):
    """What ``_clean_columns`` accepts, ``_checked_entries`` accepts with the same entries; a header the one-by-one
    check accepts with every entry well formed (no bool or negative dims) is taken by the columns too."""
    head, size = case
    path = Path("shard.safetensors")
    try:
        cols = header._clean_columns(head, 8, size)
    except (TypeError, KeyError, ValueError):
        cols = None
    try:
        slow = header._checked_entries(path, head, 8, size)
    except CorruptFileError:
        slow = None
    if cols is not None:
        assert slow is not None and header._entries(path, list(head), *cols) == slow
    elif slow is not None:
        assert any(type(d) is not int for e in head.values() for d in e["shape"]), head


W4A16_S2 = "model.layers.0.self_attn.o_proj.weight_scale_2"


def _validated(src: Path, target: str, keep_plan: bool):
    from mocli.checkpoint import open_checkpoint
    from mocli.targets import Target
    from mocli.validate import validate

    report = validate(open_checkpoint(src), Target(target), keep_plan=keep_plan)
    return [f.to_dict() for f in report.findings], report.plan


@pytest.mark.parametrize("name,target,edit", [
    ("llama-w4a16_nvfp4", "marlin", True),  # SCL006: 1e4 x 2^119 / sf is no float32
    ("llama-w4a16_nvfp4", "flashinfer-cutlass", True),  # TGT002 first: nothing is planned, the child is cancelled
    ("qwen3_moe-w4a16_nvfp4", "marlin", False),  # nothing found
])
def test_computed_scales_judged_aside_are_judged_as_here(tmp_path, monkeypatch, forks, name, target, edit):
    src = tmp_path / name
    shutil.copytree(REAL / name, src)
    if edit:
        edit_tensor(src, W4A16_S2, lambda t: t.fill_(1e4))
    got, plan = _validated(src, target, keep_plan=False)
    assert plan is None and len([j for j in forks if j is not None]) == 1
    want, kept = serial(monkeypatch, _validated, src, target, True)
    assert got == want
    assert kept is not None or any(f["severity"] == "error" for f in want)
    if edit and target == "marlin":
        assert any(f["code"] == "SCL006" and W4A16_S2 in f["location"] for f in got), got


def test_a_child_that_fails_to_judge_leaves_it_to_this_process(tmp_path, monkeypatch, forks):
    import mocli.validate.computed as computed

    src = tmp_path / "ck"
    shutil.copytree(REAL / "llama-w4a16_nvfp4", src)
    edit_tensor(src, W4A16_S2, lambda t: t.fill_(1e4))

    def broken(*a, **k):
        raise RuntimeError("only the child runs this")

    monkeypatch.setattr(computed, "check_computed", broken)  # the child's; the validate module keeps its own
    got, _ = _validated(src, "marlin", keep_plan=False)
    assert len(forks) == 1
    assert any(f["code"] == "SCL006" for f in got), got


def _validated_no_target(src: Path):
    from mocli.checkpoint import open_checkpoint
    from mocli.validate import validate

    report = validate(open_checkpoint(src))
    return [f.to_dict() for f in report.findings], report.stats["scales"]


E3 = "model.layers.1.mlp.experts.3"


@pytest.mark.parametrize("name,tensor,value,code", [
    ("qwen3_moe-nvfp4_kv", f"{E3}.up_proj.weight_scale_2", float("nan"), "SCL001"),
    ("qwen3_moe-nvfp4_kv", f"{E3}.gate_proj.weight_scale_2", -1.0, "SCL002"),
    ("qwen3_moe-nvfp4_kv", f"{E3}.gate_proj.weight_scale_2", 1e-3, "SCL005"),  # w1/w3 of one expert differ
    ("llama-ct-fp8", "model.layers.0.self_attn.k_proj.weight_scale", 1e3, "SCL004"),  # a fused shard's spread
    ("qwen3_moe-nvfp4_kv", None, None, None),
])
def test_scales_checked_aside_are_checked_as_here(tmp_path, monkeypatch, forks, name, tensor, value, code):
    src = tmp_path / name
    shutil.copytree(REAL / name, src)
    if tensor:
        edit_tensor(src, tensor, lambda t: t.fill_(value))
    got, stats = _validated_no_target(src)
    assert len([j for j in forks if j is not None]) == 1  # one shard: the scales' child alone
    assert (got, stats) == serial(monkeypatch, _validated_no_target, src)
    codes = {f["code"] for f in got}
    assert (code in codes) if code else not {c for c in codes if c.startswith("SCL")}, got


def test_a_child_that_fails_to_check_scales_leaves_it_to_this_process(tmp_path, monkeypatch, forks):
    import mocli.validate.scale as scale

    src = tmp_path / "ck"
    shutil.copytree(REAL / "qwen3_moe-nvfp4_kv", src)
    edit_tensor(src, f"{E3}.up_proj.weight_scale_2", lambda t: t.fill_(float("nan")))

    def broken(*a, **k):
        raise RuntimeError("only the child runs this")

    monkeypatch.setattr(scale, "read_scales", broken)  # the child's; the validate module keeps its own
    got, _ = _validated_no_target(src)
    assert len(forks) == 1
    assert any(f["code"] == "SCL001" for f in got), got
