"""Which commit a benchmark result came from."""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str | None:
    """$GIT_COMMIT when set, else HEAD (with -dirty for uncommitted changes).

    The GPU box gets a copy of the tree whose .git (if any) need not match it, so
    the caller says which commit it sent."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")
