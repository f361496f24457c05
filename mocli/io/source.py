"""Resolve MODEL (a local directory or a Hub repo id) to a local directory."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mocli.errors import InputError

# owner/name[@revision], the shape of a Hub repo id (huggingface_hub validates the details).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")

# Only what mocli reads: configs, index and weights (never tokenizers, images, …).
HUB_PATTERNS = ["*.json", "*.safetensors"]


@dataclass(frozen=True)
class Source:
    """Where a checkpoint lives. ``repo_id``/``revision`` are set for Hub sources."""

    path: Path
    spec: str
    repo_id: str | None = None
    revision: str | None = None

    def describe(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.repo_id else str(self.path)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_source(spec: str) -> Source:
    """Local directory as is; otherwise a Hub repo id through the HF cache (honours HF_HUB_OFFLINE)."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{spec}: not a directory", hint="pass the checkpoint directory, not a file")
        return Source(path.resolve(), spec)
    if not _REPO_ID.match(spec):
        raise InputError(f"{spec}: no such directory", hint="pass a checkpoint directory or a Hub repo id (owner/name)")
    repo_id, _, revision = spec.partition("@")
    return _download(spec, repo_id, revision or None)


def _download(spec: str, repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    try:
        local = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                  local_files_only=offline)
    except LocalEntryNotFoundError:
        if offline:
            raise InputError(f"{spec}: not in the Hugging Face cache and HF_HUB_OFFLINE is set",
                             hint="unset HF_HUB_OFFLINE or download it first") from None
        raise InputError(f"{spec}: cannot reach the Hugging Face Hub and the repo is not cached",
                         hint="check the network, or pass a local directory") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise InputError(f"{spec}: repository not found or not accessible",
                         hint="check the repo id and your HF token") from None
    except RevisionNotFoundError:
        raise InputError(f"{spec}: revision {revision!r} not found") from None
    except HFValidationError as e:
        raise InputError(f"{spec}: not a valid Hub repo id ({e})") from None
    except HfHubHTTPError as e:
        raise InputError(f"{spec}: Hub request failed: {str(e).splitlines()[0]}") from None
    local_path = Path(local)
    return Source(local_path, spec, repo_id=repo_id, revision=local_path.name)
