"""Which commit a benchmark result came from, and the result file itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def provenance(benchmark: str, argv: list[str] | None) -> dict:
    """What a result file opens with: the benchmark, the command that ran it (argv None:
    this process's), when, and the commit."""
    return {
        "benchmark": benchmark,
        "command": f"python -m benchmarks.{benchmark} "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
    }


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
