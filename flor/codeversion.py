"""The code version of a recorded script: the git commit, branch and dirty
flag of the repository it lives in, and its diff against the commit.

Read only.  git runs with ``GIT_OPTIONAL_LOCKS=0``, so that ``git status``
does not refresh the index (the one write a read command may make), the
diff comes from ``git diff-index`` (``git diff`` rewrites the index where
a file's times changed), and no prompt, pager or external diff tool runs.
The repository is the script's own: variables that point git elsewhere
(``GIT_DIR``, ``GIT_WORK_TREE``, ``GIT_INDEX_FILE``... as a git hook has
them) are left out.  A script outside a repository, a machine without git,
or a git command that fails or takes over a few seconds gives no version,
never an error: the record goes on.
"""
from __future__ import annotations

import os
import subprocess
import threading

__all__ = ["capture", "DIFF_LIMIT"]

#: The diff kept with a run is cut at this many bytes (and says so).
DIFF_LIMIT = 4 << 20
_TIMEOUT_S = 5.0


# What git --local-env-vars lists (git 2.39), should that call fail.
_REPOSITORY_VARS = ("GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG", "GIT_CONFIG_PARAMETERS",
                    "GIT_CONFIG_COUNT", "GIT_OBJECT_DIRECTORY", "GIT_DIR", "GIT_WORK_TREE",
                    "GIT_IMPLICIT_WORK_TREE", "GIT_GRAFT_FILE", "GIT_INDEX_FILE",
                    "GIT_NO_REPLACE_OBJECTS", "GIT_REPLACE_REF_BASE", "GIT_PREFIX",
                    "GIT_SHALLOW_FILE", "GIT_COMMON_DIR")


def _env() -> dict:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C",
               GIT_PAGER="cat")
    try:
        listed = subprocess.run(["git", "rev-parse", "--local-env-vars"], env=env,
                                stdin=subprocess.DEVNULL, capture_output=True,
                                timeout=_TIMEOUT_S, check=False).stdout.decode().split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    for name in set(listed) | set(_REPOSITORY_VARS):
        env.pop(name, None)
    return env


def _git(env, directory: str, *args: str) -> str | None:
    """git's output, or None where it failed or took too long."""
    try:
        out = subprocess.run(["git", "-C", directory, "--no-pager", *args], env=env,
                             stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("utf-8", "replace") if out.returncode == 0 else None


def _diff(env, directory: str) -> str | None:
    """The working tree's diff against HEAD, cut at DIFF_LIMIT bytes (what
    is past it is never read into memory), or None where git failed."""
    try:
        proc = subprocess.Popen(["git", "-C", directory, "--no-pager", "diff-index", "-p",
                                 "--binary", "--no-color", "HEAD"], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
    timer = threading.Timer(_TIMEOUT_S, proc.kill)
    timer.start()
    try:
        with proc:
            out = proc.stdout.read(DIFF_LIMIT + 1)
            cut = len(out) > DIFF_LIMIT
            if cut:
                proc.kill()
            rc = proc.wait()
    finally:
        timer.cancel()
    if not cut and rc != 0:
        return None
    text = out[:DIFF_LIMIT].decode("utf-8", "replace")
    return text + f"\n[flor: the diff was cut at {DIFF_LIMIT} bytes]\n" if cut else text


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
    env = _env()
    root = _git(env, directory, "rev-parse", "--show-toplevel")
    if root is None:
        return None, None
    commit = _git(env, directory, "rev-parse", "--verify", "-q", "HEAD")
    branch = _git(env, directory, "symbolic-ref", "--short", "-q", "HEAD")
    status = _git(env, directory, "status", "--porcelain=v1", "-z", "--untracked-files=normal")
    top = root.strip()
    dirty = untracked = diff = None  # unknown where git status failed or took too long
    if status is not None:
        entries = [e for e in status.split("\0") if e]
        mine = os.path.realpath(store) if store else None
        untracked = sum(e.startswith("?? ") and not _within(os.path.join(top, e[3:]), mine)
                        for e in entries)
        dirty = any(not e.startswith("?? ") for e in entries)
    if dirty and commit:
        diff = _diff(env, directory)
    version = {"root": top, "commit": commit.strip() if commit else None,
               "branch": branch.strip() if branch else None, "dirty": dirty,
               "untracked": untracked}
    return version, diff or None
