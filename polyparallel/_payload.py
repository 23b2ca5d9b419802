"""What ``polyparallel.launch`` sends to its processes (``fn``, ``args``, ``kwargs``), judged before
any process starts.

A process started fresh (``spawn``, a new interpreter) gets the payload pickled: functions and
classes travel by reference (module and name) and are imported again there. Two things cannot
travel that way:

- something defined in a ``__main__`` that has no file a child could run again: a notebook cell
  (Jupyter, IPython, Colab), ``python -`` (its ``__main__`` says ``<stdin>``), ``python -c``. Such
  a payload is *interactive* (:attr:`Payload.main_names`); a runtime that can start its processes
  by ``fork`` (the torch runtime) runs it so, others refuse it (:func:`refuse_interactive`).
- something that cannot be pickled at all: a lambda or a function defined inside another one, an
  open file, a lock, a torch.distributed process group. :func:`inspect_payload` names the part
  (``fn``, ``args[1]``, ``kwargs['model']``) and why (:attr:`Payload.problem`).
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import LaunchError, exception_summary

__all__ = ["Payload", "inspect_payload", "interactive_main", "refuse_interactive"]


def interactive_main() -> bool:
    """Whether ``__main__`` has no file a fresh interpreter could run again to find its functions
    (a notebook kernel, ``python -``, ``python -c``, the REPL)."""
    main = sys.modules.get("__main__")
    if main is None:
        return False
    if getattr(main, "__spec__", None) is not None:  # `python -m module`: importable by name
        return False
    path = getattr(main, "__file__", None)
    return not (isinstance(path, str) and os.path.isfile(path))


@dataclass
class Payload:
    """What :func:`inspect_payload` found.

    :ivar main_names: the functions and classes of an interactive ``__main__`` the payload
        refers to (``["train"]``): a fresh interpreter cannot import them.
    :ivar problem: why the payload cannot be pickled, naming the part and the fix (``None``: it can).
    """

    main_names: list[str] = field(default_factory=list)
    problem: str | None = None


class _Finder(pickle.Pickler):
    """A pickler that notes every function or class of ``__main__`` it is asked to save."""

    def __init__(self, file: Any, found: list[str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found = found

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, type) or callable(obj)) and getattr(obj, "__module__", None) == "__main__":
            name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
            if name not in self.found:
                self.found.append(name)
        return NotImplemented


def _what(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _fix(part: str, obj: Any, exc: BaseException) -> str:
    """The advice for a part that cannot be pickled."""
    name = getattr(obj, "__qualname__", "") if callable(obj) else ""
    if "<lambda>" in name:
        return (f"{part} is a lambda, which cannot be pickled: define it with `def` at the top level of a "
                "module (a file), or in the notebook/`__main__` itself.")
    if "<locals>" in name:
        return (f"{part} ({name}) is defined inside another function, which cannot be pickled: define it at "
                "the top level of a module, and pass what it closes over as arguments.")
    text = f"{exception_summary(exc)} {_what(obj)}"
    if "ProcessGroup" in text or "Store" in text:
        return (f"{part} holds a torch.distributed process group or store, which lives only in the process that "
                "made it: build it inside fn (each launched process has its own; the strategy's operations "
                "need none).")
    return (f"{part} ({_what(obj)}) cannot be pickled: {exception_summary(exc)}. Pass something picklable, "
            "or build it inside fn (pass what it is made from instead).")


def inspect_payload(fn: Any, args: tuple, kwargs: Mapping[str, Any]) -> Payload:
    """Pickle ``fn``, ``args`` and ``kwargs`` as a spawned process would get them; see :class:`Payload`."""
    payload = Payload()
    interactive = interactive_main()
    parts = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] + \
        [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    for part, obj in parts:
        try:
            _Finder(io.BytesIO(), payload.main_names).dump(obj)
        except Exception as exc:
            if payload.problem is None:
                payload.problem = _fix(part, obj, exc)
            if interactive and getattr(obj, "__module__", None) == "__main__":
                name = getattr(obj, "__qualname__", None) or _what(obj)
                if name not in payload.main_names:
                    payload.main_names.append(name)
    if not interactive:
        payload.main_names.clear()
    return payload


def refuse_interactive(payload: Payload, runtime: str, how: str) -> None:
    """Raise a :class:`LaunchError` (before any process starts) when ``payload`` is interactive: the ``runtime`` starts its processes
    as ``how`` says (fresh interpreters), which cannot import what ``__main__`` defines."""
    if not payload.main_names:
        return
    names = ", ".join(payload.main_names[:5])
    raise LaunchError(
        f"launch(): {names} {'is' if len(payload.main_names) == 1 else 'are'} defined in an interactive __main__ "
        f"(a notebook cell, `python -`, `python -c`), and the {runtime!r} runtime starts {how}, which cannot "
        f"import {'it' if len(payload.main_names) == 1 else 'them'}. Put the function (and what it uses) in a "
        "file next to the notebook (a cell starting with `%%writefile train_fn.py` writes one) and import it "
        "from there; see docs/operations/launch.md#notebooks.")
