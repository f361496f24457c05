"""mocli's speed and memory goals, measured on whole processes against the I/O floor.

    python tests/bench/bench.py [--rounds 2] [--scratch DIR] [--only convert,inspect,...] [--device cpu|cuda]

Every line prints both contenders' whole-process seconds (interpreter and torch start-up included),
the ratio and the goal. The floor is the shared ``floor.py`` (read every tensor with plain
safetensors and write it back out), run interleaved with mocli in the same rounds; beside it, the
physical anchor ``cp -r --reflink=never`` of the same source files, in the same rounds; all contenders
start from the same state (their previous output removed before the timer starts). Synthetic
checkpoints come from the shared ``make_big.py``. A ratio is reported as the median over rounds,
with every round's value, and whether it meets the goal - including when it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# mocli from this checkout first, then whatever the caller had on the path (wheels installed elsewhere)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
SHARED = Path(os.environ.get("MOCLI_SHARED", ROOT.parent / "shared")) / "bench"
GIB = 1 << 30


@dataclass
class Run:
    wall: float
    cpu: float
    rss: int  # bytes, the process's peak


def timed(cmd: list[str], env: dict | None = None) -> Run:
    """Whole-process wall, CPU and peak RSS of one command (the child's rusage, from wait4)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})})
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{err.decode()[-2000:]}")
    return Run(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024)


WARM_BYTES = int(os.environ.get("MOCLI_BENCH_WARM_GB", "8")) << 30


def fresh(path: Path) -> None:
    """Put both contenders in the same state before the timer starts: no previous output, nothing
    dirty, and warm free memory. On the VMs we measure on, memory that has been free for a few
    seconds goes back to the host and costs 5-10x more to touch again (writing 4.5 GB into the page
    cache took 16 s of system time cold, 2 s warm), so whichever command ran on cold memory lost.
    Touching (then freeing) a few GiB right before each timed command removes that bias. It is done
    in a child process: a child's peak RSS (wait4) starts from its parent's peak, so the benchmark
    process itself must stay small."""
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
    warm_memory()


def warm_memory() -> None:
    """Touch (then free) a few GiB of memory right before a timed command (see ``fresh``)."""
    if WARM_BYTES:
        subprocess.run([sys.executable, "-c", f"import numpy; numpy.ones({WARM_BYTES}, dtype=numpy.uint8)"],
                       check=True)


def warm(src: Path) -> None:
    for f in src.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` (computed here, not read from mocli's manifest); files
    are hashed in parallel threads (hashlib drops the GIL)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(p for p in root.rglob("*") if p.is_file())

    def one(f: Path) -> str:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while b := fh.read(16 << 20):
                h.update(b)
        return h.hexdigest()

    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as ex:
        return dict(zip((str(f.relative_to(root)) for f in files), ex.map(one, files), strict=True))


def size_gib(src: Path) -> float:
    return sum(f.stat().st_size for f in src.rglob("*.safetensors")) / GIB


def line(what: str, a: list[Run], b: list[Run] | None, goal: float, a_name: str = "mocli",
         b_name: str = "floor") -> dict:
    ratios = [x.wall / y.wall for x, y in zip(a, b, strict=True)] if b else [x.wall / goal for x in a]
    med = statistics.median(ratios)
    ok = med <= (1.0 if b is None else goal)
    parts = [f"{what}: {a_name} {statistics.median(x.wall for x in a):.2f} s (cpu {statistics.median(x.cpu for x in a):.1f} s)"]
    if b:
        parts.append(f"{b_name} {statistics.median(x.wall for x in b):.2f} s (cpu {statistics.median(x.cpu for x in b):.1f} s)")
        parts.append(f"ratio {med:.2f} [{', '.join(f'{r:.2f}' for r in ratios)}]; goal <= {goal:g}")
    else:
        parts.append(f"ratio to {goal:g} s {med:.2f} [{', '.join(f'{r:.2f}' for r in ratios)}]; goal <= 1")
    print(" | ".join(parts) + (" | meets" if ok else " | MISSES"), flush=True)
    return {"what": what, "ratio": med, "rounds": ratios, "goal": goal, "meets": ok,
            "mocli_s": [x.wall for x in a], "other_s": [x.wall for x in b] if b else None}


def make(kind: str, out: Path, *args: str) -> Path:
    if not (out / "model.safetensors.index.json").exists():
        print(f"[making {kind} checkpoint at {out} ...]", flush=True)
        subprocess.run([sys.executable, str(SHARED / "make_big.py"), kind, str(out), *args], check=True,
                       capture_output=True)
    return out


def make_ct(scratch: Path, script: str = "to_ct.py", name: str = "ct-nvfp4") -> Path:
    """make_big's NVFP4 MoE respelled as compressed-tensors (tests/bench/to_ct.py, or to_mxfp4.py for its
    MXFP4 form; untimed)."""
    out = scratch / name
    if not (out / "model.safetensors.index.json").exists():
        src = make("moe-nvfp4", scratch / "nvfp4")
        print(f"[respelling {src} as compressed-tensors at {out} ...]", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(src), str(out)], check=True)
    return out


def mocli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mocli", "-q", *args]


# The targets each convert case is written for, and the outputs verify is timed on (against their convert)
CONVERT_TARGETS = {"NVFP4": ("flashinfer-cutlass", "flashinfer-trtllm", "marlin"),
                   "FP8": ("flashinfer-cutlass", "flashinfer-trtllm"),
                   "CT-NVFP4": ("flashinfer-cutlass", "flashinfer-trtllm"),
                   "CT-MXFP4": ("marlin", "flashinfer-trtllm")}
VERIFIED = {("NVFP4", "flashinfer-trtllm"), ("NVFP4", "marlin"), ("CT-MXFP4", "marlin"),
            ("CT-MXFP4", "flashinfer-trtllm")}
CP_GOAL = 1.25  # convert / cp of the same source bytes (the physical anchor beside the floor)


def bench_convert(scratch: Path, rounds: int, device: str, results: list, algos: set[str],
                  targets: set[str] | None = None) -> None:
    cases = [("NVFP4", lambda: make("moe-nvfp4", scratch / "nvfp4"), 1.0),
             ("FP8", lambda: make("moe-fp8", scratch / "fp8", "--layers", "4"), 1.15),
             ("CT-NVFP4", lambda: make_ct(scratch), 1.0),  # compressed-tensors' spelling of the NVFP4 one
             ("CT-MXFP4", lambda: make_ct(scratch, "to_mxfp4.py", "ct-mxfp4"), 1.0)]  # its MXFP4 experts
    for algo, made, goal in cases:
        if algo.lower() not in algos:
            continue
        src = made().resolve()  # cp -r of a symlinked source would copy the link, not the files
        warm(src)
        gib = size_gib(src)
        for target in [t for t in CONVERT_TARGETS[algo] if targets is None or t in targets]:
            a, b, c, v = convert_rounds(src, scratch, rounds, device, target, (algo, target) in VERIFIED)
            what = f"convert {algo} MoE {gib:.2f} GiB {target} --device {device}"
            results.append(line(f"{what} / I/O floor", a, b, goal))
            results.append(line(f"{what} / cp", a, c, CP_GOAL, "mocli", "cp"))
            if v:
                results.append(line(f"verify {gib:.2f} GiB {algo} {target} output --device {device} / its convert",
                                    v, a, 1.0, "verify", "convert"))
            if v and device == "cuda" and algo == "NVFP4" and target == "flashinfer-trtllm":
                results.append(line(f"verify {gib:.2f} GiB NVFP4 output --device cuda, whole process", v, None, 10.0,
                                    "verify"))
                bench_load(scratch / "out", rounds, results)
    for d in ("out", "floor-out", "cp-out"):
        fresh(scratch / d)


def convert_rounds(src: Path, scratch: Path, rounds: int, device: str, target: str,
                   verify: bool) -> tuple[list[Run], list[Run], list[Run], list[Run]]:
    """Interleaved rounds of the floor, ``cp`` of the same files, the conversion and (``verify``) verify of
    that round's output. A conversion runs on the CPU whatever --device says (it only moves bytes): the
    same path under --device cuda, which the GPU machine's figures are taken with."""
    floor = [sys.executable, str(SHARED / "floor.py")]
    a, b, c, v = [], [], [], []
    for _ in range(rounds):
        fresh(scratch / "floor-out")
        b.append(timed([*floor, str(src), str(scratch / "floor-out")]))
        fresh(scratch / "cp-out")
        c.append(timed(["cp", "-r", "--reflink=never", str(src), str(scratch / "cp-out")]))
        fresh(scratch / "out")
        a.append(timed(mocli("convert", str(src), "-o", str(scratch / "out"), "--target", target, "--device", device)))
        if verify:
            # verify of the output this round's convert wrote, right after it, from the state the convert
            # started from: nothing dirty (else it pays for writing back the convert's 4 GB beside its own
            # work) and warm memory; paired with that convert
            os.sync()
            warm_memory()
            v.append(timed(mocli("verify", str(scratch / "out"), "--device", device)))
    return a, b, c, v


def bench_load(out: Path, rounds: int, results: list) -> None:
    """The vLLM plugin's byte path (parameters first, then each shard read onto the GPU and copied in) and
    load_converted(..., device="cuda"), each against plain safetensors loading the same files onto the GPU."""
    one = [sys.executable, str(Path(__file__).with_name("load_one.py"))]
    a, b, c = [], [], []
    for _ in range(rounds):
        b.append(timed([*one, "safetensors", str(out), "--device", "cuda"]))
        a.append(timed([*one, "plugin", str(out), "--device", "cuda"]))
        c.append(timed([*one, "mocli", str(out), "--device", "cuda"]))
    results.append(line(f"load {size_gib(out):.2f} GiB converted output onto cuda through the plugin's path, "
                        "whole process", a, b, 1.0, "plugin path", "safetensors.load_file"))
    results.append(line(f"load {size_gib(out):.2f} GiB converted output onto cuda, whole process", c, b, 1.0,
                        "load_converted", "safetensors.load_file"))


def bench_headers(scratch: Path, rounds: int, results: list) -> None:
    src = make("headers", scratch / "headers", "--layers", "61", "--experts", "128")
    warm(src)
    n = json.loads(subprocess.run(mocli("--json", "inspect", str(src)), capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": PYTHONPATH}).stdout)["num_tensors"]
    results.append(line(f"inspect, {n} tensors", [timed(mocli("inspect", str(src))) for _ in range(rounds)], None, 1.0))
    results.append(line(f"validate, {n} tensors", [timed(mocli("validate", str(src))) for _ in range(rounds)], None, 1.5))
    # with a target validate also plans the conversion (SCL006 judges the scales it computes); marlin is the
    # target whose constraints this checkpoint meets (2I = 64 is no multiple of 128 for the flashinfer ones)
    results.append(line(f"validate --target marlin, {n} tensors (plans the conversion)",
                        [timed(mocli("validate", str(src), "--target", "marlin")) for _ in range(rounds)], None, 1.5))
    # header-only commands must not import torch
    # (main called with argv returns through SystemExit; as the program it leaves by os._exit, printing nothing)
    probe = (f"import sys\nfrom mocli.cli import main\ntry:\n    main(['-q', 'validate', {str(src)!r}])\n"
             "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": PYTHONPATH}).stdout.strip().splitlines()[-1]
    print(f"validate imports torch: {imported} | goal False | {'meets' if imported == 'False' else 'MISSES'}")
    results.append({"what": "validate imports torch", "meets": imported == "False"})
    # on two cores or more, half the headers and the target's plan go to forked children (mocli.io.aside): a
    # thread or an import that quietly turned that off would show here first
    cores = len(os.sched_getaffinity(0))
    trace = subprocess.run(mocli("validate", str(src), "--target", "marlin"), capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": PYTHONPATH, "MOCLI_TRACE": "1"}).stderr
    children, want = trace.count("aside: child"), 2 if cores > 1 else 0
    print(f"validate --target marlin children forked: {children} | goal {want} ({cores} cores) | "
          f"{'meets' if children == want else 'MISSES'}")
    results.append({"what": "validate forks its children", "meets": children == want})


def bench_rss(scratch: Path, results: list) -> None:
    """Peak RSS converting one >= 2 GB MoE layer against 1 GiB + 2 x the largest input tensor."""
    src = make("moe-fp8", scratch / "rss", "--layers", "1", "--experts", "128", "--hidden", "4096", "--inter", "2048")
    warm(src)
    largest = 4096 * 2048  # one FP8 expert projection
    fresh(scratch / "out")
    r = timed(mocli("convert", str(src), "-o", str(scratch / "out"), "--target", "flashinfer-cutlass", "--device", "cpu"))
    budget = GIB + 2 * largest
    ok = r.rss <= budget
    print(f"peak RSS converting one {size_gib(src):.2f} GiB MoE layer: {r.rss / GIB:.2f} GiB | budget 1 GiB + 2 x "
          f"{largest / 2**20:.0f} MiB = {budget / GIB:.2f} GiB | ratio {r.rss / budget:.2f}; goal <= 1 | "
          f"{'meets' if ok else 'MISSES'}")
    results.append({"what": "peak RSS", "ratio": r.rss / budget, "meets": ok})
    fresh(scratch / "out")


def bench_quantize(scratch: Path, rounds: int, device: str, results: list) -> None:
    src = scratch / "bf16"
    if not (src / "model.safetensors.index.json").exists():
        # in a child: this process stays small, since a child's peak RSS (wait4) starts from its parent's
        print(f"[making BF16 MoE checkpoint at {src} ...]", flush=True)
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_bf16.py")), str(src)], check=True)
    warm(src)
    floor = [sys.executable, str(SHARED / "floor.py")]
    on_cpu = device == "cuda"
    a, b, c = [], [], []
    for _ in range(rounds):
        fresh(scratch / "floor-out")
        b.append(timed([*floor, str(src), str(scratch / "floor-out")]))
        fresh(scratch / "out")
        a.append(timed(mocli("quantize", str(src), "-o", str(scratch / "out"), "--device", device)))
        if on_cpu:
            fresh(scratch / "out-cpu")
            c.append(timed(mocli("quantize", str(src), "-o", str(scratch / "out-cpu"), "--device", "cpu")))
    results.append(line(f"quantize BF16 MoE {size_gib(src):.2f} GiB --device {device} / I/O floor", a, b, 1.3))
    if on_cpu:
        results.append(line("quantize BF16 MoE --device cuda / --device cpu", a, c, 1.0, "cuda", "cpu"))
        same = tree_digest(scratch / "out") == tree_digest(scratch / "out-cpu")
        print(f"quantize output bytes, cuda vs cpu: {'identical' if same else 'DIFFER'} | goal identical | "
              f"{'meets' if same else 'MISSES'}", flush=True)
        results.append({"what": "quantize cuda bytes == cpu bytes", "meets": same})
        fresh(scratch / "out-cpu")
    largest = max(a, key=lambda r: r.rss)
    unit = 2 * 1536 * 4096 * 2  # one expert's w1 + w3 in BF16: the largest unit
    print(f"quantize peak RSS {largest.rss / GIB:.2f} GiB | budget 1 GiB + 2 x unit {unit / 2**20:.0f} MiB = "
          f"{(GIB + 2 * unit) / GIB:.2f} GiB | {'meets' if largest.rss <= GIB + 2 * unit else 'MISSES'}")
    if device == "cuda":
        # what a process pays for CUDA alone (torch imported, a context made, one pinned buffer): the part
        # of the peak that is not mocli's
        base = max(timed([sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); "
                          "torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)"]).rss for _ in range(2))
        print(f"quantize --device cuda peak RSS above a process that only starts CUDA ({base / GIB:.2f} GiB): "
              f"{(largest.rss - base) / GIB:.2f} GiB | budget 1 GiB + 2 x unit | "
              f"{'meets' if largest.rss - base <= GIB + 2 * unit else 'MISSES'}", flush=True)
    fresh(scratch / "out")
    fresh(scratch / "floor-out")


def cache_bytecode() -> None:
    """Some machines set PYTHONDONTWRITEBYTECODE (the GPU machines' image also ships packages without ``.pyc``
    files), so every process there would compile mocli, its dependencies and the standard library from source:
    what no installed environment does (pip and Python's installers compile). There, compile the standard
    library and every installed package once, untimed, beside their sources (``compileall`` writes whatever the
    variable says), and let the timed processes write what is still missing (their first round). A
    ``PYTHONPYCACHEPREFIX`` would not do: under it Python ignores the ``__pycache__`` folders the installers
    wrote, and compiles whatever the prefix lacks at every start (measured on the 2-core VM: inspect 0.92 s under
    c67ffd1's prefix, 0.58 s this way)."""
    if not os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        return
    import sysconfig

    dirs = [str(ROOT / "mocli")] + sorted({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
    print(f"[this Python writes no bytecode: compiling {len(dirs)} folders once, untimed]", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scratch", type=Path, default=ROOT / "bench-out")
    ap.add_argument("--only", default="headers,convert,rss,quantize")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--algos", default="nvfp4,fp8,ct-nvfp4,ct-mxfp4", help="convert cases to run")
    ap.add_argument("--targets", help="convert targets to run (default: each algorithm's all)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if not (SHARED / "floor.py").exists():
        raise SystemExit(f"{SHARED}/floor.py not found: set MOCLI_SHARED to the shared folder that holds bench/")
    a.scratch.mkdir(parents=True, exist_ok=True)
    cache_bytecode()
    procs = subprocess.run([sys.executable, "-c", "import mocli.workers as w; print(w.PROCS, w.UNIT_PROCS)"],
                           capture_output=True, text=True, cwd=ROOT).stdout.split()
    print(f"mocli bench: {os.cpu_count()} cores, device {a.device}, {a.rounds} rounds, scratch {a.scratch}, "
          f"worker processes (mocli.workers): {' for verify, '.join(procs)} for a conversion's units", flush=True)
    results: list = []
    only = set(a.only.split(","))
    if "headers" in only:
        bench_headers(a.scratch, max(a.rounds, 3), results)
    if "convert" in only:
        bench_convert(a.scratch, a.rounds, a.device, results, set(a.algos.lower().split(",")),
                      set(a.targets.split(",")) if a.targets else None)
    if "rss" in only:
        bench_rss(a.scratch, results)
    if "quantize" in only:
        bench_quantize(a.scratch, a.rounds, a.device, results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
