"""What keeps the hang reports' side channel (:mod:`.tracing`) to the job's own processes: stores
bound to loopback, a per-job key, signed values, and checks of every value read.

A ``TCPStore`` is unauthenticated and, unless it is handed a listening socket, listens on every
interface: anyone who reaches its port can read, write and delete every key. Polyparallel therefore

* binds the stores it serves for a single-host job to loopback (:func:`loopback_store`: a socket
  bound to ``127.0.0.1`` handed to ``TCPStore(master_listen_fd=)``, which both of torch's store
  servers accept);
* signs what the channel writes (:func:`seal`: HMAC-SHA256 over the key's name and the value with a
  32-byte key that rank 0 draws and hands to its peers over the process group, never through a
  store), so a request or a state that does not carry the key is not believed;
* checks every value it reads (:func:`unseal`, :func:`state_problem`: size, signature, JSON, the
  type of every field), so a malformed or forged value is ignored and counted, never trusted and
  never fatal. The channel never uses ``store.add`` on a key others can write: a non-integer value
  there makes the store server drop the connection.

Values are signed, not encrypted: a state published in answer to a (signed) request can be read
by whoever reaches the store. See the operations guide on hangs for what each launcher exposes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import socket
from typing import Any

from polyparallel._trace_report import entry_problem

__all__ = ["KEY_BYTES", "MAX_VALUE", "is_loopback", "loopback_store", "seal", "unseal", "state_problem",
           "request_problem"]

KEY_BYTES = 32
"""Length of the per-job key (bytes)."""
MAX_VALUE = 256 * 1024
"""The largest value the channel reads (bytes); a state is a few kilobytes."""
_MAX_ENTRIES = 64
_MAX_STACK = 64 * 1024


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address literal (``127.0.0.1``, ``::1``) or ``localhost``."""
    if not host:
        return False
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_store(port: int = 0, host: str = "127.0.0.1", **kwargs: Any) -> Any:
    """A ``TCPStore`` server listening on ``host`` (a loopback address) only, at ``port`` (0: any
    free one); ``kwargs`` go to ``TCPStore``. Raises ``OSError`` when the port is taken."""
    import torch.distributed as dist

    address = "127.0.0.1" if host in ("localhost", "") else host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
        port = sock.getsockname()[1]
        # The store's server owns the socket from here on (it closes it).
        return dist.TCPStore(address, port, is_master=True, master_listen_fd=sock.detach(), **kwargs)
    except BaseException:
        sock.close()
        raise


def _mac(key: bytes, name: str, body: bytes) -> str:
    return hmac.new(key, name.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def seal(key: bytes, name: str, value: Any) -> bytes:
    """``value`` as JSON, signed for the store key ``name`` (a signed value moved to another key
    is not believed there)."""
    body = json.dumps(value, separators=(",", ":")).encode()
    return _mac(key, name, body).encode() + b":" + body


def unseal(key: bytes, name: str, raw: Any) -> tuple[Any, str | None]:
    """``(value, None)`` for a value :func:`seal` wrote to ``name`` with ``key``, else
    ``(None, why)``."""
    if not isinstance(raw, (bytes, bytearray)):
        return None, f"{name}: not bytes ({type(raw).__name__})"
    if len(raw) > MAX_VALUE:
        return None, f"{name}: {len(raw)} bytes (at most {MAX_VALUE})"
    mac, sep, body = bytes(raw).partition(b":")
    if not sep or not hmac.compare_digest(mac, _mac(key, name, body).encode()):
        return None, f"{name}: not signed with this job's key (forged, or from another job)"
    try:
        return json.loads(body), None
    except ValueError as exc:  # signed but not JSON: cannot happen unless the key leaked
        return None, f"{name}: not JSON ({exc})"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def request_problem(value: Any) -> str | None:
    """Why ``value`` is not a request (``{"gen": int >= 1, "rank": int >= 0}``), or ``None``."""
    if not isinstance(value, dict) or not _int(value.get("gen")) or not _int(value.get("rank")):
        return "a request is {'gen': int, 'rank': int}"
    if value["gen"] < 1 or value["rank"] < 0:
        return f"a request's generation and rank are positive (got {value['gen']}, {value['rank']})"
    return None


_MAX_OUTCOME = 400


def state_problem(value: Any, rank: int) -> str | None:
    """Why ``value`` is not a state rank ``rank`` published (see :mod:`polyparallel._trace_report`
    for the fields), or ``None``."""
    if not isinstance(value, dict):
        return f"a state is a JSON object, not {type(value).__name__}"
    if value.get("rank") != rank or not _int(value.get("rank")):
        return f"the state of rank {rank} names rank {str(value.get('rank'))[:20]!r}"
    if not _int(value.get("gen")) or value["gen"] < 0:
        return f"the state's generation is {str(value.get('gen'))[:20]!r}, not an integer >= 0"
    if not isinstance(value.get("exited"), bool):
        return "the state's 'exited' is not true or false"
    if not isinstance(value.get("time"), (int, float)) or isinstance(value.get("time"), bool):
        return "the state's 'time' is not a number"
    stack = value.get("stack")
    if stack is not None and (not isinstance(stack, str) or len(stack) > _MAX_STACK):
        return "the state's 'stack' is not a text of at most 64 KiB"
    outcome = value.get("outcome")
    if outcome is not None and (not isinstance(outcome, str) or len(outcome) > _MAX_OUTCOME):
        return f"the state's 'outcome' is not a text of at most {_MAX_OUTCOME} characters"
    entries = value.get("entries")
    if not isinstance(entries, list) or len(entries) > _MAX_ENTRIES:
        return f"the state's 'entries' is not a list of at most {_MAX_ENTRIES}"
    for entry in entries:
        problem = entry_problem(entry)
        if problem:
            return problem
    return None
