"""Scale rehearsal: a DeepSeek-sized NVFP4 MoE conversion, one process against torchrun.

    python tests/bench/scale.py --gb 40 --procs 1,2 [--tp 8] [--target flashinfer-cutlass] [--device cuda]
    make scale GB=40 PROCS=1,2

What it does, in order (everything but the generation is a timed whole process):

1. Generation, untimed: ``make_big.py moe-nvfp4`` makes one DeepSeek-R1-shaped MoE layer (hidden
   7168, moe_intermediate 2048) with a few distinct experts; the layer is then cloned, byte for byte
   through the kernel, into as many 256-expert layers as reach ``--gb`` (rewriting only the
   headers' names). make_big draws every byte through torch's single-threaded generator (~0.15
   GB/s), too slow for 100 GB; the clones cost disk bandwidth only, and convert does the same work
   on cloned bytes as on fresh ones.
2. The disk: sequential write (O_DIRECT + fsync) and read (O_DIRECT) bandwidth with ``dd``.
3. The I/O floor (``floor.py``: plain safetensors reads every tensor and writes it back) on the warm
   page cache, then ``mocli convert --tp T`` in one process, then under ``torchrun --nproc-per-node
   N`` for every N in ``--procs``; peak RSS of every process (each torchrun rank reports its own);
   SHA-256 of every output file computed here, compared with the one-process output.
4. ``mocli verify`` of rank 0 alone and of all ranks, on the last output.
5. A table and an extrapolation to ``--extrapolate`` GB (default 400, DeepSeek-R1 in NVFP4): the
   measured throughput, and the disk bound (every byte read once and written once) when the model
   does not fit in the page cache.

Outputs are removed after they are hashed, so the disk holds the source and one output at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# mocli from this checkout first, then whatever the caller had on the path (wheels installed elsewhere)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(ROOT))

from tests.bench.bench import GIB, SHARED, fresh, timed, tree_digest, warm  # noqa: E402

HIDDEN, INTER, EXPERTS = 7168, 2048, 256  # DeepSeek-R1
BASE_EXPERTS = 16


# --- generation ----------------------------------------------------------------------------------

def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _write_clone(src: Path, dst: Path, entries: list[tuple[str, str, list, tuple[int, int] | bytes]],
                 start: int) -> None:
    """Write ``dst`` with tensors ``(name, dtype, shape, source byte range or the bytes)``; ranges of
    ``src`` are copied in the kernel."""
    out, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in entries:
        n = len(data) if isinstance(data, bytes) else data[1] - data[0]
        out[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(out, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(src, "rb") as fi, open(dst, "wb", buffering=0) as fo:  # raw: copy_file_range moves its offset
        fo.write(struct.pack("<Q", len(blob)) + blob)
        for _, _, _, data in entries:
            if isinstance(data, bytes):
                fo.write(data)
                continue
            n, o = data[1] - data[0], start + data[0]
            while n:
                k = os.copy_file_range(fi.fileno(), fo.fileno(), n, o)
                if k == 0:
                    raise SystemExit(f"short copy from {src}")
                n, o = n - k, o + k


def make_scaled(out: Path, gb: float) -> tuple[Path, int]:
    """A ``gb``-sized NVFP4 MoE checkpoint of DeepSeek-shaped layers; returns (dir, layers)."""
    done = out / "model.safetensors.index.json"
    if done.exists():
        return out, json.loads((out / "config.json").read_text())["num_hidden_layers"]
    base = out.with_name(out.name + "-base")
    if not (base / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, str(SHARED / "make_big.py"), "moe-nvfp4", str(base), "--layers", "1",
                        "--experts", str(BASE_EXPERTS), "--hidden", str(HIDDEN), "--inter", str(INTER)],
                       check=True, capture_output=True)
    head_file, layer_file = sorted(base.glob("model-*.safetensors"))
    hdr, start = _header(layer_file)
    hdr.pop("__metadata__", None)
    per_expert = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in hdr.items() if ".experts.0." in k)
    rest = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in hdr.items() if ".experts." not in k)
    layers = max(1, round(gb * 1e9 / (per_expert * EXPERTS + rest)))
    tmp = out.with_name(out.name + ".making")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n_files = layers + 1
    names = [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]
    shutil.copyfile(head_file, tmp / names[0])
    weight_map = {k: names[0] for k in _header(head_file)[0] if k != "__metadata__"}
    expert = re.compile(r"^model\.layers\.0\.mlp\.experts\.(\d+)\.(.*)$")
    router = "model.layers.0.mlp.gate.weight"
    shared_names = [k for k in hdr if not expert.match(k) and k != router]
    def entry(name: str, old: str) -> tuple:
        return name, hdr[old]["dtype"], hdr[old]["shape"], tuple(hdr[old]["data_offsets"])

    with open(layer_file, "rb") as f:  # the router (E x hidden BF16) for 256 experts: base rows repeated
        a, b = hdr[router]["data_offsets"]
        f.seek(start + a)
        router_rows = f.read(b - a) * (EXPERTS // BASE_EXPERTS)
    for L in range(layers):
        pre = f"model.layers.{L}."
        entries = [entry(k.replace("model.layers.0.", pre, 1), k) for k in shared_names]
        entries.append((pre + "mlp.gate.weight", hdr[router]["dtype"], [EXPERTS, HIDDEN], router_rows))
        for e in range(EXPERTS):
            for k in hdr:
                m = expert.match(k)
                if m and int(m.group(1)) == e % BASE_EXPERTS:
                    entries.append(entry(f"{pre}mlp.experts.{e}.{m.group(2)}", k))
        _write_clone(layer_file, tmp / names[L + 1], entries, start)
        weight_map.update({e[0]: names[L + 1] for e in entries})
        print(f"  generated layer {L + 1}/{layers}", flush=True)
    total = sum((tmp / n).stat().st_size for n in names)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, num_experts=EXPERTS, num_local_experts=EXPERTS)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    q = json.loads((base / "hf_quant_config.json").read_text())
    q["quantization"]["exclude_modules"] = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{L}.mlp.gate" for L in range(layers)]
    (tmp / "hf_quant_config.json").write_text(json.dumps(q, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(base)
    return out, layers


# --- measuring -----------------------------------------------------------------------------------

def disk_bandwidth(scratch: Path, gib: int) -> tuple[float, float] | None:
    """Sequential (write, read) GB/s past the page cache, with dd; None where dd or O_DIRECT is missing."""
    f = scratch / "dd-probe"
    try:
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={gib * 16}", "oflag=direct",
                        "conv=fsync"], check=True, capture_output=True)
        w = gib * GIB / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True, capture_output=True)
        r = gib * GIB / (time.perf_counter() - t) / 1e9
        return w, r
    except (OSError, subprocess.CalledProcessError):
        return None
    finally:
        f.unlink(missing_ok=True)


def anon_file_peaks(cmd: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RssAnon, peak RssFile) of a command, sampled every 0.1 s: ru_maxrss counts
    the file pages a process maps (verify views the source and the output through maps; they are page
    cache, not memory it holds), so the two are told apart here."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": PYTHONPATH})
    anon = file = 0
    while p.poll() is None:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
        except OSError:
            break
        kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("Rss")}
        anon, file = max(anon, kib.get("RssAnon", 0) << 10), max(file, kib.get("RssFile", 0) << 10)
        time.sleep(0.1)
    if p.wait() != 0:
        raise SystemExit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - t0, anon, file


def mocli_convert(src: Path, out: Path, a: argparse.Namespace) -> list[str]:
    return ["-q", "convert", str(src), "-o", str(out), "--target", a.target, "--tp", str(a.tp),
            "--device", a.device]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=40.0, help="checkpoint size to generate (GB)")
    ap.add_argument("--procs", default="1,2", help="torchrun process counts to time (besides one plain process)")
    ap.add_argument("--tp", type=int, default=8)
    # cutlass: make_big's attention (k, v = hidden/4) gives a rank 1344 qkv rows at tp 8, and trtllm
    # needs multiples of 128 (SEMANTICS §10; DeepSeek itself uses MLA)
    ap.add_argument("--target", default="flashinfer-cutlass")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scratch", type=Path, default=ROOT / "bench-out" / "scale")
    ap.add_argument("--extrapolate", type=float, default=400.0, help="GB to extrapolate to")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if not (SHARED / "floor.py").exists():
        raise SystemExit(f"{SHARED}/floor.py not found: set MOCLI_SHARED to the shared folder that holds bench/")
    a.scratch.mkdir(parents=True, exist_ok=True)
    procs = [int(p) for p in a.procs.split(",") if p.strip()]

    t = time.perf_counter()
    src, layers = make_scaled(a.scratch / "src", a.gb)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"source: {size / 1e9:.1f} GB NVFP4 MoE, {layers} layers x {EXPERTS} experts, hidden {HIDDEN}, "
          f"moe_intermediate {INTER} (ready in {time.perf_counter() - t:.0f} s, untimed)", flush=True)
    disk = disk_bandwidth(a.scratch, 8)
    if disk:
        print(f"disk: sequential write {disk[0]:.2f} GB/s, read {disk[1]:.2f} GB/s (O_DIRECT, 8 GiB)", flush=True)
    warm(src)

    rows: list[dict] = []

    def row(what: str, procs: int, r, rss: list[int], same: str, floor_s: float | None) -> None:
        d = {"what": what, "procs": procs, "seconds": r.wall, "cpu_s": r.cpu, "gb_s": size / r.wall / 1e9,
             "ratio": r.wall / floor_s if floor_s else 1.0, "peak_rss_gib": [x / GIB for x in rss], "identical": same}
        rows.append(d)
        print(f"{what}: {r.wall:.1f} s, {d['gb_s']:.2f} GB/s, ratio to floor {d['ratio']:.2f}, peak RSS "
              f"{', '.join(f'{x:.2f}' for x in d['peak_rss_gib'])} GiB, bytes {same}", flush=True)

    out = a.scratch / "out"
    fresh(out)
    floor = timed([sys.executable, str(SHARED / "floor.py"), str(src), str(out)])
    row("I/O floor (floor.py)", 1, floor, [floor.rss], "-", None)
    fresh(out)
    one = timed([sys.executable, "-m", "mocli", *mocli_convert(src, out, a)])
    ref = tree_digest(out)
    row(f"mocli convert --tp {a.tp} --device {a.device}, one process", 1, one, [one.rss],
        f"reference ({len(ref)} files)", floor.wall)
    for n in procs:
        fresh(out)
        rss_dir = a.scratch / "rss"
        shutil.rmtree(rss_dir, ignore_errors=True)
        rss_dir.mkdir()
        r = timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                   str(Path(__file__).with_name("rank_rss.py")), str(rss_dir), *mocli_convert(src, out, a)],
                  env={"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))})
        rss = [int(p.read_text()) for p in sorted(rss_dir.glob("rank*"))]
        same = "identical" if tree_digest(out) == ref else "DIFFER"
        row(f"torchrun --nproc-per-node {n} mocli convert --tp {a.tp} --device {a.device}", n, r, rss, same,
            floor.wall)
    verify = {}
    if not a.no_verify:
        for label, extra in (("rank 0", ["--rank", "0"]), ("all ranks", [])):
            wall, anon, file = anon_file_peaks([sys.executable, "-m", "mocli", "-q", "verify", str(out),
                                                "--device", a.device, *extra])
            verify[label] = {"seconds": wall, "rss_anon_gib": anon / GIB, "rss_file_gib": file / GIB}
            print(f"verify {label} --device {a.device}: {wall:.1f} s (peak RSS: {anon / GIB:.2f} GiB anonymous, "
                  f"{file / GIB:.2f} GiB mapped file pages)", flush=True)
    fresh(out)

    best = min(rows[1:], key=lambda d: d["seconds"])
    ext = a.extrapolate * 1e9
    print("\n| size | processes | seconds | GB/s | ratio to floor | peak RSS GiB | bytes |\n|---|---|---|---|---|---|---|")
    for d in rows:
        print(f"| {size / 1e9:.1f} GB | {d['what']} | {d['seconds']:.1f} | {d['gb_s']:.2f} | {d['ratio']:.2f} | "
              f"{', '.join(f'{x:.2f}' for x in d['peak_rss_gib'])} | {d['identical']} |")
    for k, v in verify.items():
        print(f"| {size / 1e9:.1f} GB | verify {k} | {v['seconds']:.1f} | {size / v['seconds'] / 1e9:.2f} | | "
              f"{v['rss_anon_gib']:.2f} anon + {v['rss_file_gib']:.2f} mapped | |")
    print(f"\nextrapolated to {a.extrapolate:.0f} GB at the best measured rate ({best['what']}): "
          f"{ext / (best['gb_s'] * 1e9) / 60:.1f} min (page cache warm)")
    if disk:
        bound = ext / (disk[1] * 1e9) + ext / (disk[0] * 1e9)
        print(f"disk bound for {a.extrapolate:.0f} GB read once and written once at the measured {disk[1]:.2f} / "
              f"{disk[0]:.2f} GB/s: {bound / 60:.1f} min; the larger of the two is the estimate")
    if a.json:
        a.json.write_text(json.dumps({"size_bytes": size, "layers": layers, "disk_gb_s": disk, "rows": rows,
                                      "verify_s": verify}, indent=1))


if __name__ == "__main__":
    main()
