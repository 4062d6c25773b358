"""Where a result came from: the git commit of the code that produced it, recorded in every result JSON of
``triforce bench``, ``triforce analyze`` and ``bench/``."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: the checkout this package runs from (src/triforce/lab -> the repository root)
_ROOT = Path(__file__).resolve().parents[3]


def git_commit() -> dict:
    """``{"git_commit": the HEAD commit's hash, "git_dirty": whether tracked files differ from it}`` of the checkout
    this package runs from; both None outside a git checkout (an installed wheel) or without git. Raises nothing."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit or None, "git_dirty": None if status is None else bool(status)}
