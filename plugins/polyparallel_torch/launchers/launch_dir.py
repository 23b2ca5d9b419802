"""The directory of one function-mode launch: where each worker saves its outcome.

Each launch works in ``$TMPDIR/polyparallel-launch-<pid>-<random>``, removed when the launch
ends. A worker saves its result as ``<rank>.pkl`` (:func:`result_path`) or its failure record as
``<rank>.err.json`` (:func:`error_path`), each written atomically. The directory holds a lock for
the launcher's lifetime, so a directory left by a killed launcher is recognised (its lock is free)
and removed by the next launch (:func:`remove_stale_launch_dirs`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

__all__ = ["error_path", "launch_dir", "remove_stale_launch_dirs", "result_path"]

_DIR_PREFIX = "polyparallel-launch-"
_LOCK_NAME = "launcher.lock"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: launches work, stale directories are not judged
    fcntl = None  # type: ignore[assignment]


def result_path(outdir: str, rank: int) -> str:
    """Where ``rank`` saves its pickled result."""
    return os.path.join(outdir, f"{rank}.pkl")


def error_path(outdir: str, rank: int) -> str:
    """Where ``rank`` saves its failure record (:mod:`.records`)."""
    return os.path.join(outdir, f"{rank}.err.json")


@contextlib.contextmanager
def launch_dir() -> Iterator[str]:
    """A new, locked launch directory, removed when the block ends."""
    path = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    # Locked before it gets its name: another launcher's cleanup never sees it unlocked.
    lock = os.open(os.path.join(path, f".{_LOCK_NAME}"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel however this process ends
        os.rename(os.path.join(path, f".{_LOCK_NAME}"), os.path.join(path, _LOCK_NAME))
        yield path
    finally:
        os.close(lock)
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_launch_dirs(root: str | None = None) -> list[str]:
    """Remove this user's launch directories whose launcher is gone (killed before its cleanup).

    A directory is stale when nobody holds its lock; directories of running launches, of other
    users, or not made by this module are left alone. Returns the paths removed.
    """
    removed: list[str] = []
    if fcntl is None:  # pragma: no cover - without locks nothing can be judged stale
        return removed
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        try:
            if (not re.fullmatch(re.escape(_DIR_PREFIX) + r"\d+-\w+", entry.name)
                    or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid()):
                continue
            fd = os.open(os.path.join(entry.path, _LOCK_NAME), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its launcher is running
        finally:
            os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
