"""Which commit a benchmark result came from."""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str | None:
    """HEAD (with -dirty for uncommitted changes); outside a checkout, $GIT_COMMIT.

    The GPU box gets a copy of the tree without .git, so the caller says there."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GIT_COMMIT")
    return sha + ("-dirty" if dirty else "")
