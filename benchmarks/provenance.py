"""Which commit a benchmark result came from, and the result file itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


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


def write_result(path: Path | None, result: dict) -> None:
    """The result as indented JSON at path (its directory made); nothing if path is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def package_version(package: str) -> str | None:
    """An installed distribution's version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
