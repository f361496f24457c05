"""Stream a plan's units into pre-planned shards: the one mechanism convert, repair and quantize share.

Each concern has its own room:

- ``units``: what a plan is made of (output tensors, units, pieces of bytes);
- ``pool``: pooled CPU buffers and the context a unit runs in;
- ``outdir``: the partial directory beside OUT, the lock, the publishing rename;
- ``journal``: finished units and the run's fingerprint, for resume;
- ``writer``: the writer lanes (``pwrite`` or vmsplice + splice / ``copy_file_range`` on background threads);
- ``hashing``: every output file's digest, taken as its bytes complete;
- ``dist``: one process, or several under torchrun;
- ``job``: a job from prepare (or resume) to publish.

Never prints: progress goes through callbacks, errors are typed exceptions.
"""

from mocli.progress import Progress
from mocli.stream.dist import Dist, TorchDist, dist_from_env
from mocli.stream.job import Job, JobResult, run
from mocli.stream.journal import fingerprint
from mocli.stream.outdir import check_output, lock_path, partial_dir
from mocli.stream.pool import BufferPool, UnitContext
from mocli.stream.units import BadData, Key, OutTensor, Piece, Plan, SourceRange, Unit, concat_pieces

__all__ = ["BadData", "BufferPool", "Dist", "Job", "JobResult", "Key", "OutTensor", "Piece", "Plan", "Progress",
           "SourceRange", "TorchDist", "Unit", "UnitContext", "check_output", "concat_pieces", "dist_from_env",
           "fingerprint", "lock_path", "partial_dir", "run"]
