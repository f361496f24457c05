"""convert time / I/O floor, and convert peak RSS, on synthetic multi-GB MoE checkpoints.

I/O floor: read every source shard with ``safetensors.torch.load_file`` and write the same tensors
with ``save_file`` (plain safetensors, same machine, same warm page cache). Prints ratios; the
targets are time <= 1.15 x floor and peak RSS <= 1 GiB + 2 x the largest input tensor.

    python tests/bench/bench_convert.py [--gb 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def make_moe(root: Path, algo: str, hidden: int, inter: int, experts: int, layers: int) -> int:
    """Random-byte MoE checkpoint (one shard per layer); w1/w3 scales differ so every expert is repaired."""
    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map, largest = {}, 0
    for layer in range(layers):
        t: dict[str, torch.Tensor] = {}
        p = f"model.layers.{layer}."
        t[p + "mlp.gate.weight"] = torch.zeros(experts, hidden, dtype=torch.bfloat16)
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for e in range(experts):
            for j, (proj, n, k) in enumerate((("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                                              ("down_proj", hidden, inter))):
                m = f"{p}mlp.experts.{e}.{proj}."
                if algo == "FP8":
                    w = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
                    t[m + "weight"] = w
                    t[m + "weight_scale"] = torch.tensor(1e-3 * (1 + j), dtype=torch.float32)
                    t[m + "input_scale"] = torch.tensor(2e-2, dtype=torch.float32)
                else:
                    t[m + "weight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
                    t[m + "weight_scale"] = torch.randint(0, 0x7E, (n, k // 16), dtype=torch.uint8,
                                                          generator=g).view(torch.float8_e4m3fn)
                    t[m + "weight_scale_2"] = torch.tensor(1e-4 * (1 + j), dtype=torch.float32)
                    t[m + "input_scale"] = torch.tensor(3e-3, dtype=torch.float32)
                largest = max(largest, t[m + "weight"].numel() * t[m + "weight"].element_size())
        fname = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, str(root / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in t}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    q = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["model.layers.*.mlp.gate"]}
    if algo == "NVFP4":
        q["group_size"] = 16
    (root / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": q}))
    (root / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    return largest


def warm(src: Path) -> None:
    for f in src.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def io_floor(src: Path, dst: Path) -> float:
    dst.mkdir()
    t0 = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        save_file(load_file(str(f)), str(dst / f.name))
    os.sync()
    return time.perf_counter() - t0


# Runs the real CLI in a child and reports VmHWM (peak RSS of this process image) at exit.
# getrusage's ru_maxrss is no good here: Linux carries it across fork+exec, so a child of this
# (large) bench process would report the parent's size.
_CHILD = """
import atexit, re, sys
def hwm():
    kb = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)
    sys.stderr.write(f"MAXRSS {kb}\\n")
atexit.register(hwm)
from mocli.cli import main
main(sys.argv[1:])
"""


def run_convert(src: Path, dst: Path, target: str) -> tuple[float, float, int]:
    """(convert seconds as reported by mocli, process wall seconds, peak RSS bytes) of `mocli convert`."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _CHILD, "--json", "convert", str(src), "-o", str(dst),
                        "--target", target, "--device", "cpu"], check=True, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.sync()
    wall = time.perf_counter() - t0
    rss = int(p.stderr.rsplit("MAXRSS", 1)[1].split()[0]) * 1024
    return json.loads(p.stdout)["seconds"], wall, rss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=3.0, help="approximate size of each synthetic checkpoint")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    a = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mocli-bench-", dir=a.dir))
    try:
        hidden, inter = 2048, 1024
        per_expert = {"FP8": 3 * hidden * inter, "NVFP4": 3 * hidden * inter // 2 * 17 // 16}
        for algo, target in (("FP8", "flashinfer-trtllm"), ("NVFP4", "flashinfer-cutlass")):
            experts = 64
            layers = max(1, round(a.gb * 1e9 / (per_expert[algo] * experts)))
            src = scratch / f"src-{algo}"
            make_moe(src, algo, hidden, inter, experts, layers)
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            warm(src)
            floor = io_floor(src, scratch / f"floor-{algo}")
            shutil.rmtree(scratch / f"floor-{algo}")
            dt, wall, _ = run_convert(src, scratch / f"out-{algo}", target)
            shutil.rmtree(scratch / f"out-{algo}")
            print(f"convert {algo} MoE {size / 1e9:.2f} GB ({target}): {dt:.2f} s (process incl. startup "
                  f"{wall:.2f} s); I/O floor {floor:.2f} s; ratio {dt / floor:.2f} (target <= 1.15)")
            shutil.rmtree(src)

        # Peak RSS: one MoE layer >= 2 GB (FP8, 128 experts of 3 x 2048 x 2816 bytes = 2.2 GB).
        src = scratch / "src-rss"
        largest = make_moe(src, "FP8", 2048, 2816, 128, 1)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        _, _, rss = run_convert(src, scratch / "out-rss", "flashinfer-cutlass")
        budget = GIB + 2 * largest
        print(f"peak RSS converting one {size / 1e9:.2f} GB MoE layer: {rss / GIB:.2f} GiB; budget "
              f"1 GiB + 2 x {largest / 2**20:.0f} MiB = {budget / GIB:.2f} GiB; ratio {rss / budget:.2f} (target <= 1.0)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
