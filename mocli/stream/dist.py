"""Processes: one, or several started by torchrun that share the work units."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mocli.errors import PeerLost


class Dist:
    """One process. ``TorchDist`` is the torchrun version; the stream runner only needs these four calls."""

    world, rank = 1, 0

    def barrier(self) -> None:
        pass

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def close(self) -> None:
        pass


class TorchDist(Dist):
    """torch.distributed as torchrun starts it: gloo for the small objects the stream runner exchanges, and
    NCCL beside it on GPU machines (each process on its own GPU, cuda:LOCAL_RANK)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as td

        self.td = td
        if not td.is_initialized():
            backend = "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
                backend = "cpu:gloo,cuda:nccl"
            td.init_process_group(backend=backend)
        self.world, self.rank = td.get_world_size(), td.get_rank()
        # objects travel over gloo whatever the default backend is
        self.group = td.new_group(backend="gloo") if torch.cuda.is_available() else None

    def _collective(self, call: Callable[[], Any]) -> Any:
        """A collective that fails does so because a peer is gone (killed, or stopped on its own error,
        which that process reports): said as such, never as this process's internal error."""
        try:
            return call()
        except Exception as e:
            raise PeerLost(f"process {self.rank} of {self.world}: another process of this run stopped "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'no message'})",
                           hint="see the other processes' output for why") from e

    def barrier(self) -> None:
        self._collective(lambda: self.td.barrier(group=self.group))

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._collective(lambda: self.td.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._collective(lambda: self.td.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def close(self) -> None:
        if self.td.is_initialized():
            self.td.destroy_process_group()


def dist_from_env() -> Dist:
    """TorchDist when started by torchrun with more than one process, else the single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return TorchDist()
    return Dist()
