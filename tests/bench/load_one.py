"""One whole-process load onto a device, for the load benchmark (bench.py runs each mode in its own process).

    python tests/bench/load_one.py mocli OUT [--device cuda]    # mocli.loader.load_converted: the whole rank
    python tests/bench/load_one.py plugin OUT [--device cuda]   # the vLLM plugin's byte path, without vLLM
    python tests/bench/load_one.py safetensors OUT [--device cuda]  # safetensors.torch.load_file, every shard
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["mocli", "plugin", "safetensors"])
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
    elif a.mode == "plugin":
        # what mocli.vllm_plugin.loader.MocliModelLoader does with the bytes (vLLM is not needed for that,
        # and the GPU machine has none): the parameters exist first (vLLM builds the model, then loads),
        # the rank's entries come from rank_entries, each shard is read by shard_into (the loader's own
        # call) straight into the parameters. What this leaves out is vLLM's own model
        # building and its load_weights for the BF16 pass-through tensors, which any checkpoint pays.
        from mocli.formats.layout import rank_entries, read_layout
        from mocli.io.safetensors_file import torch_dtypes
        from mocli.loader import shard_into

        entries = rank_entries(a.path, read_layout(a.path), None)
        dtypes = torch_dtypes()
        params = {n: torch.empty(e.shape, dtype=dtypes[e.dtype], device=a.device) for n, e in entries.items()}
        for rest in shard_into(entries.values(), params, a.device):
            assert not rest
        nbytes = sum(p.nbytes for p in params.values())
    else:
        from safetensors.torch import load_file

        for f in sorted(a.path.rglob("*.safetensors")):
            nbytes += sum(t.nbytes for t in load_file(f, device=a.device).values())
    if torch.device(a.device).type == "cuda":
        torch.cuda.synchronize()
    print(nbytes)


if __name__ == "__main__":
    main()
