"""Run mocli as ``python -m mocli ARGS`` and write this process's peak RSS (bytes) to DIR/rank<RANK>.

    torchrun --nproc-per-node N tests/bench/rank_rss.py DIR convert ...

torchrun's own wait status only tells the largest process's peak; this gives every rank's. mocli
ends a process that loaded torch with ``os._exit`` (no atexit handlers), so the report is written
there too."""

import atexit
import os
import resource
import runpy
import sys
from pathlib import Path

out = Path(sys.argv[1])


@atexit.register
def _report() -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{os.environ.get('RANK', '0')}").write_text(str(peak))


_exit = os._exit


def _report_then_exit(code: int) -> None:
    _report()
    _exit(code)


os._exit = _report_then_exit
sys.argv = ["mocli", *sys.argv[2:]]
runpy.run_module("mocli", run_name="__main__", alter_sys=True)
