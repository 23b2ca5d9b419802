"""``polyparallel/_payload.py``: what launch() would send its processes, judged before any starts."""

import subprocess
import sys
import textwrap
import threading

import pytest

import polyparallel as pp
from polyparallel._payload import inspect_payload, interactive_main


def _module_level(x):
    return x


def test_a_module_level_payload_passes_and_is_not_interactive():
    payload = inspect_payload(_module_level, (1, [2, 3]), {"s": pp.Strategy(data=2)})
    assert payload.problem is None and payload.main_names == []
    assert not interactive_main()  # pytest's __main__ is a file


@pytest.mark.parametrize(("fn", "args", "kwargs", "message"), [
    (lambda: 1, (), {}, r"^fn is a lambda, which cannot be pickled: define it with `def`"),
    (_module_level, (1, threading.Lock()), {}, r"^args\[1\] \(_thread\.lock\) cannot be pickled: TypeError: cannot pickle"),
    (_module_level, (), {"model": lambda: 2}, r"^kwargs\['model'\] is a lambda"),
])
def test_the_part_that_cannot_be_pickled_is_named(fn, args, kwargs, message):
    assert inspect_payload(fn, args, kwargs).problem is not None
    assert __import__("re").search(message, inspect_payload(fn, args, kwargs).problem)


def test_a_nested_function_is_named_with_its_fix():
    def train():
        return 1

    problem = inspect_payload(train, (), {}).problem
    assert problem.startswith("fn (test_a_nested_function_is_named_with_its_fix.<locals>.train) is defined inside "
                              "another function")
    with pytest.raises(TypeError, match=r"must be picklable to reach the processes: fn \(.*<locals>.train\) is "
                                        r"defined inside another function"):
        pp.launch(train, pp.Strategy(data=2), 2, timeout=30)


PROBE = textwrap.dedent("""
    import json, threading
    from polyparallel._payload import inspect_payload, interactive_main

    class Net:
        pass

    def train(net):
        return net

    ok = inspect_payload(train, (Net(),), {})
    bad = inspect_payload(lambda: 1, (threading.Lock(),), {})
    print(json.dumps([interactive_main(), ok.main_names, ok.problem, bad.main_names, bad.problem is not None]))
""")


def test_a_payload_of_a_file_less_main_is_interactive():
    # `python -` (its __main__.__file__ is '<stdin>') and `python -c`: no file a fresh process could run.
    for argv, stdin in ((["-"], PROBE), (["-c", PROBE], "")):
        out = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert __import__("json").loads(out.stdout.splitlines()[-1]) == [True, ["train", "Net"], None, ["<lambda>"],
                                                                         True]
