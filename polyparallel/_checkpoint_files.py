"""The integrity of a checkpoint's files: a content hash of every file, taken while it is written.

Format version 2 of the commit marker (:mod:`polyparallel._checkpoints`) records, next to each
file's size, the SHA-256 of its bytes (``"sha256": {relative path: hex digest}``), and a per-save
identity (``"id"``) that the runtime also writes into its own files. A load (and ``polyparallel
checkpoint inspect``) recomputes the hashes, so a flipped byte or a file of another checkpoint
copied over one of this one (same size: a size check passes it) is refused, naming the file.

The hashes are taken *while writing*, not by reading the files again: :class:`HashingStream`
wraps the stream a writer writes into (the torch runtime wraps DCP's file streams with it) and
:func:`write_bytes` writes a small file (JSON) and hashes the same bytes. A runtime whose writer
cannot be wrapped (orbax writes through tensorstore) hashes its files once before the commit
(:func:`hash_file`), and says so in its documentation. SHA-256: the fastest cryptographic hash of
the standard library where the CPU has SHA extensions (hashlib releases the GIL while hashing).

Verification reads every file once; several ranks share the work (:func:`shares`: each hashes
about ``1/world`` of the bytes) and agree on the outcome through one collective of their runtime.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ._errors import CheckpointError

__all__ = ["HASH", "HashingStream", "hash_file", "problems", "shares", "write_bytes"]

#: The content hash of format version 2 (the marker's key holding the digests).
HASH = "sha256"
_CHUNK = 8 << 20
#: The commit marker's name (``_checkpoints.MARKER``; repeated here to keep this module a leaf).
_MARKER = "polyparallel-checkpoint.json"


def new_hash() -> Any:
    """A fresh :data:`HASH` object."""
    return hashlib.new(HASH)


class HashingStream:
    """A binary stream that hashes every byte written through it, in order, and forwards
    everything else to the stream it wraps (``tell``, ``fileno`` for ``fsync``, ``flush``, ...).

    The digest is only that of the file when the file is written front to back from an empty
    file: a ``seek`` makes :attr:`digest` ``None``, and the caller then hashes the file by reading
    it (:func:`hash_file`).
    """

    def __init__(self, raw: Any):
        self._raw, self._hash, self._written, self._sequential = raw, new_hash(), 0, True

    def write(self, data: Any) -> int:
        count = self._raw.write(data)
        view = memoryview(data).cast("B")
        written = len(view) if count is None else count
        self._hash.update(view[:written])
        self._written += written
        return written

    def seek(self, *args: Any) -> int:
        self._sequential = False
        return self._raw.seek(*args)

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> HashingStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()

    @property
    def size(self) -> int:
        """The bytes written through the wrapper."""
        return self._written

    @property
    def digest(self) -> str | None:
        """The hex digest of the file, or ``None`` when it was not written front to back."""
        return self._hash.hexdigest() if self._sequential else None


class Records:
    """Thread-safe ``relative path -> (size, digest)`` of the files one process wrote (several
    writer threads may record at once). ``digest`` ``None``: hash it by reading (:meth:`complete`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, str | None]] = {}

    def add(self, rel: str, size: int, digest: str | None) -> None:
        with self._lock:
            self._files[rel.replace(os.sep, "/")] = (size, digest)

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self._files:
                self._files[new] = self._files.pop(old)

    def complete(self, directory: str) -> dict[str, tuple[int, str]]:
        """Every record with its digest (a file that was not written front to back is hashed now)."""
        with self._lock:
            files = dict(self._files)
        return {rel: (size, digest if digest is not None else hash_file(os.path.join(directory, rel)))
                for rel, (size, digest) in sorted(files.items())}


def os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` that is ``exc`` or caused it (its ``__cause__``/``__context__`` chain), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def naming(exc: OSError, path: Any) -> OSError:
    """``exc`` with the file it is about (an error of ``write`` or ``fsync`` names none)."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror, os.fspath(path))


def write_bytes(path: str, data: bytes) -> tuple[int, str]:
    """Write ``data`` to ``path`` durably (flushed and fsynced before it returns); returns its size
    and digest, computed from the bytes written. An ``OSError`` names the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise naming(exc, path) from exc
    return len(data), hashlib.new(HASH, data).hexdigest()


def hash_file(path: str) -> str:
    """The hex digest of the file ``path`` (read once, in chunks)."""
    digest = new_hash()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def on_disk(directory: str) -> dict[str, int]:
    """Relative path -> size of every file under ``directory`` except the marker (and its temporary file)."""
    sizes = {}
    for root, _, names in os.walk(directory):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            if rel not in (_MARKER, _MARKER + ".tmp"):
                sizes[rel] = os.path.getsize(full)
    return dict(sorted(sizes.items()))


def check_records(directory: str, records: Mapping[str, tuple[int, str]]) -> None:
    """Refuse to commit ``directory`` when its files are not exactly the ones recorded while
    writing (a file missing, another size on disk, a file nobody recorded)."""
    present = on_disk(directory)
    missing = sorted(set(records) - set(present))
    unrecorded = sorted(set(present) - set(records))
    resized = sorted(rel for rel in set(records) & set(present) if records[rel][0] != present[rel])
    if missing or unrecorded or resized:
        parts = ([f"written but missing: {missing[:4]}"] if missing else []) + (
            [f"present but written by no rank of this save: {unrecorded[:4]}"] if unrecorded else []) + (
            ["another size on disk than written: " + ", ".join(
                f"{rel} {present[rel]} bytes, {records[rel][0]} written" for rel in resized[:4])] if resized else [])
        raise CheckpointError(f"{directory!r} cannot be committed: its files are not the ones this save wrote ("
                              + "; ".join(parts) + "). Is the directory on a file system every rank shares? "
                              "Save again to a fresh path.")


def shares(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """The files each of ``world`` ranks hashes to verify a checkpoint: about equal bytes each
    (largest first, to the rank with the fewest bytes so far), the same split on every rank."""
    parts: list[list[str]] = [[] for _ in range(max(1, world))]
    load = [0] * len(parts)
    for rel in sorted(sizes, key=lambda r: (-int(sizes[r]), r)):
        i = load.index(min(load))
        parts[i].append(rel)
        load[i] += int(sizes[rel])
    return parts


def problems(path: str, metadata: Mapping[str, Any], hashed: Iterable[str] | None = None) -> list[str]:
    """What is wrong with the files of the committed checkpoint ``path``: a file missing or of
    another size than at commit (every file: ``stat`` only), and a file whose content hash differs
    from the one recorded at commit (the files in ``hashed``; ``None``: every file). A checkpoint
    of format version 1 records sizes only. Empty when all is well."""
    recorded = metadata.get("files")
    if not isinstance(recorded, dict):
        return [f"{path!r}: its {_MARKER} lists no files; the checkpoint cannot be checked."]
    found = []
    for rel, size in recorded.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            found.append(f"{path!r} is incomplete: {rel} is missing (it was written at commit). Copy the whole "
                         "directory, or load an earlier checkpoint.")
        elif os.path.getsize(full) != size:
            found.append(f"{path!r} is corrupt: {rel} has {os.path.getsize(full)} bytes, {size} when it was "
                         "committed (truncated or overwritten). Load an earlier checkpoint.")
    if found or int(metadata.get("version", 1)) < 2:
        return found
    digests = metadata.get(HASH)
    if not isinstance(digests, dict) or set(digests) != set(recorded):
        return [f"{path!r}: its {_MARKER} (format version {metadata.get('version')}) does not record the {HASH} "
                "of every file; the checkpoint cannot be checked. Load an earlier checkpoint."]
    for rel in sorted(recorded if hashed is None else hashed):
        if hash_file(os.path.join(path, rel)) != digests[rel]:
            found.append(f"{path!r} is corrupt: {rel} is not the file this checkpoint wrote (its SHA-256 differs "
                         "from the one recorded at commit: bytes changed on disk, or a file of another checkpoint "
                         "copied over it). Load an earlier checkpoint, or copy the whole directory again.")
    return found


def foreign(path: str, where: str, found: Any, expected: Any) -> str:
    """The refusal of a file that carries another save's identity."""
    return (f"{path!r} is corrupt: {where} belongs to another save (save id {found!r}; this checkpoint's is "
            f"{expected!r}): a file of another checkpoint was copied in. Load an earlier checkpoint, or copy the "
            "whole directory again.")
