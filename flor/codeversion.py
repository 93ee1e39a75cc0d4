"""The code version of a recorded script: the git commit, branch and dirty
flag of the repository it lives in, and its diff against the commit.

Read only.  git runs with ``GIT_OPTIONAL_LOCKS=0``, so that ``git status``
does not refresh the index (the one write a read command may make), and
with no prompt, no pager and no external diff tool.  A script outside a
repository, a machine without git, or a git command that fails or takes
over a few seconds gives no version, never an error: the record goes on.
"""
from __future__ import annotations

import os
import subprocess

__all__ = ["capture", "DIFF_LIMIT"]

#: The diff kept with a run is cut at this many bytes (and says so).
DIFF_LIMIT = 4 << 20
_TIMEOUT_S = 5.0


def _git(directory: str, *args: str) -> str | None:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C",
               GIT_PAGER="cat")
    try:
        out = subprocess.run(["git", "-C", directory, "--no-pager", *args], env=env,
                             stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("utf-8", "replace") if out.returncode == 0 else None


def _within(path: str, directory: str | None) -> bool:
    if directory is None:
        return False
    path = os.path.realpath(path)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def capture(script: str, store: str | None = None) -> tuple[dict | None, str | None]:
    """(the version of the repository holding `script`, its diff against
    HEAD or None), or (None, None) outside a repository.  The version:
    {"root", "commit", "branch", "dirty", "untracked"}; commit is None before
    the first commit, branch None on a detached HEAD; dirty: tracked files
    differ from the commit; untracked: how many files git does not track
    (and does not ignore), less flor's own `store` directory (both None
    where git status failed)."""
    directory = os.path.dirname(os.path.abspath(script))
    root = _git(directory, "rev-parse", "--show-toplevel")
    if root is None:
        return None, None
    commit = _git(directory, "rev-parse", "--verify", "-q", "HEAD")
    branch = _git(directory, "symbolic-ref", "--short", "-q", "HEAD")
    status = _git(directory, "status", "--porcelain=v1", "-z", "--untracked-files=normal")
    top = root.strip()
    dirty = untracked = diff = None  # unknown where git status failed or took too long
    if status is not None:
        entries = [e for e in status.split("\0") if e]
        mine = os.path.realpath(store) if store else None
        untracked = sum(e.startswith("?? ") and not _within(os.path.join(top, e[3:]), mine)
                        for e in entries)
        dirty = any(not e.startswith("?? ") for e in entries)
    if dirty and commit:
        diff = _git(directory, "diff", "--no-ext-diff", "--no-color", "--binary", "HEAD")
        if diff and len(diff.encode()) > DIFF_LIMIT:
            diff = diff.encode()[:DIFF_LIMIT].decode("utf-8", "ignore") + \
                f"\n[flor: the diff was cut at {DIFF_LIMIT} bytes]\n"
    version = {"root": top, "commit": commit.strip() if commit else None,
               "branch": branch.strip() if branch else None, "dirty": dirty,
               "untracked": untracked}
    return version, diff or None
