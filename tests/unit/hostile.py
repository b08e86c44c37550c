"""Hostile inputs for the loaders: policies with very many problems, and files that block.

As a script, it writes a policy with N problems, to time `nodeagent validate` on it:

    python tests/unit/hostile.py bad-tenants 20000 > /tmp/bad-tenants.yaml    # about 449 KB
    python tests/unit/hostile.py unknown-keys 20000 > /tmp/unknown-keys.yaml
    time nodeagent validate /tmp/bad-tenants.yaml

`bad-tenants N` gives N tenants whose shares are negative; `unknown-keys N` gives one tenant
with N unknown keys. Each has exactly N problems.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable


def bad_tenants(n: int) -> str:
    return "version: 1\ntenants:\n" + "".join(f"  t{i}: {{shares: -1}}\n" for i in range(n))


def unknown_keys(n: int) -> str:
    return "version: 1\ntenants:\n  a:\n    shares: 1\n" + "".join(
        f"    k{i}: 1\n" for i in range(n)
    )


KINDS = {"bad-tenants": bad_tenants, "unknown-keys": unknown_keys}


def outcome_without_blocking_on(fifo: str, call: Callable[[], object]) -> object:
    """What `call` returns or raises. Should it block opening `fifo` for reading, the test
    fails instead of hanging: a writer opens the FIFO after 10 s to release it."""
    result: list[object] = []

    def run() -> None:
        try:
            result.append(call())
        except Exception as e:
            result.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the blocked open return
        thread.join(10)
        raise AssertionError(f"blocked opening the FIFO {fifo}")
    return result[0]


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS or not sys.argv[2].isdigit():
        sys.exit(f"usage: {sys.argv[0]} {{{' | '.join(KINDS)}}} N")
    sys.stdout.write(KINDS[sys.argv[1]](int(sys.argv[2])))
