"""Where the controller keeps its checkpoint (rayscale.core.checkpoint): a file on the local cluster, a
ConfigMap on Kubernetes (rayscale.cluster.kube.checkpoint). A store reads and writes text; what the text
holds, and whether it is still worth restoring, is the checkpoint's business."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

CHECKPOINT_FILE = "controller-checkpoint.json"  # the local cluster's, in its root


class StateStore(Protocol):
    @property
    def where(self) -> str:
        """Names the store in messages (a path, namespace/name)."""
        ...

    def read(self) -> str | None:
        """The last checkpoint written, None when there is none."""
        ...

    def write(self, text: str) -> None:
        """Replace the checkpoint with ``text``; raises when it could not."""
        ...


class FileStore:
    """One file, replaced atomically (a crash mid-write leaves the previous checkpoint)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def where(self) -> str:
        return str(self.path)

    def read(self) -> str | None:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def write(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
