"""torch, imported on a background thread from a command's start.

Importing torch costs 1.5-2 s of one core on the 2-core build machines and 3-4.5 s on an H200 host:
most of a conversion whose weights are only copied. Convert, repair and quantize read headers, plan
and start the kernel's copies without torch (``mocli.plan``, ``Unit.copies``) while it loads here;
the first unit that needs torch imports it as usual, which waits for this import to finish (Python's
import lock) instead of starting a second one.
"""

from __future__ import annotations

import sys
import threading

_started = threading.Event()
SWITCH_INTERVAL = 0.0002  # seconds, while torch loads


def torch_in_background() -> None:
    """Start importing torch on a daemon thread (once; nothing if it is loaded already)."""
    if "torch" in sys.modules or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_load, name="mocli-torch-import", daemon=True).start()


def _load() -> None:
    # The import holds the GIL most of its time, and every other thread that wants it back (a writer
    # lane after each copy_file_range, the main thread handing out units) waits a switch interval
    # for it: at 5 ms, handing the copies of 768 expert weights to 3 lanes took 2.9 s on an H200
    # host beside the import, against 2.0 s for the whole stream without it.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
    try:
        import torch  # noqa: F401
    except BaseException:  # noqa: BLE001 - the import that needs torch repeats it and reports the error
        return
    finally:
        sys.setswitchinterval(interval)
