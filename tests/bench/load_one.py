"""One whole-process load onto a device, for the load benchmark (bench.py runs each mode in its own process).

    python tests/bench/load_one.py mocli OUT [--device cuda]    # mocli.loader.load_converted: the whole rank
    python tests/bench/load_one.py safetensors OUT [--device cuda]  # safetensors.torch.load_file, every shard
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["mocli", "safetensors"])
    ap.add_argument("path", type=Path)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    nbytes = 0
    if a.mode == "mocli":
        from mocli.loader import load_converted

        ck = load_converted(a.path, device=a.device)
        for mod in ck.modules.values():
            nbytes += sum(v.nbytes for v in vars(mod).values() if isinstance(v, torch.Tensor))
        nbytes += sum(t.nbytes for t in ck.passthrough.values())
    else:
        from safetensors.torch import load_file

        for f in sorted(a.path.rglob("*.safetensors")):
            nbytes += sum(t.nbytes for t in load_file(f, device=a.device).values())
    if torch.device(a.device).type == "cuda":
        torch.cuda.synchronize()
    print(nbytes)


if __name__ == "__main__":
    main()
