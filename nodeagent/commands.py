"""Commands: how the API's threads change the daemon's state without changing it themselves.

The loop is the only thread that changes state. An API handler that would change it
(start or finish a job, ask for GPUs, reserve them) is posted here as a command and waits
for its answer; the loop runs the pending commands between ticks and wakes for them while
it waits (`Wakeup`), so a command waits at most for the tick in progress. Without the lock
the handlers took, a save of the state file from a handler could no longer race the
loop's own save (the last rename won, and a job just started could vanish from the file),
and a handler could no longer hold a lock the loop waits on while it does cgroup I/O.

A command from the loop's own thread, or where no loop runs (`--once`, a test driving
ticks by hand), runs at once in the caller. One that the loop has not taken within its
timeout is withdrawn and answered 503; a stopping loop answers those still queued the same,
and so every command posted after it stopped.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from nodeagent.api.server import Handler, Request, Routes, prepared
from nodeagent.errors import TryLater
from nodeagent.wakeup import Wakeup

T = TypeVar("T")


class Commands:
    def __init__(self, wakeup: Wakeup, timeout: float = 30.0) -> None:
        self._wakeup = wakeup
        self.timeout = timeout
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = (
            queue.SimpleQueue()
        )
        self._loop: int | None = None
        self._stopped = False
        """A loop ran and is gone: commands are refused, never run in their callers, beside
        the stopping loop's last save."""
        self._direct = threading.Lock()  # commands run in their callers while no loop runs

    def bind(self) -> None:
        """The calling thread is the loop from now on: bound before the API serves, so that
        no command runs in an API thread while the loop starts."""
        self._loop = threading.get_ident()

    def unbind(self) -> None:
        """No loop runs commands any more: those still queued, and any posted later, are
        answered 503."""
        if self._loop is not None:
            self._stopped = True
        self._loop = None
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(TryLater("the daemon is stopping"))

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop's thread and return what it returns (or raise what it
        raised)."""
        loop = self._loop
        if loop is None and self._stopped:
            raise TryLater("the daemon is stopping")
        if loop is None or loop == threading.get_ident():
            with self._direct if loop is None else contextlib.nullcontext():
                return fn()
        future: Future[object] = Future()
        self._queue.put((fn, future))
        self._wakeup.poke()
        try:
            return future.result(self.timeout)  # type: ignore[return-value]
        except FutureTimeout:
            if future.cancel():
                raise TryLater(
                    f"the daemon's loop did not take this request within {self.timeout:g} s"
                    " (a tick that long is logged as tick.slow); try again"
                ) from None
            return future.result()  # type: ignore[return-value]  # running: let it finish
        except CancelledError:
            raise TryLater("the daemon is stopping") from None

    def run_pending(self) -> int:
        """On the loop's thread: run every queued command; how many ran."""
        ran = 0
        while True:
            try:
                fn, future = self._queue.get_nowait()
            except queue.Empty:
                return ran
            if not future.set_running_or_notify_cancel():
                continue  # withdrawn by its caller's timeout
            ran += 1
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

    def serve(self, routes: Routes, then: Callable[[], object]) -> Routes:
        """`routes` as the API serves them: a GET answers on the API's thread (from a view
        the loop published); any other method is a command, its body checked first on the
        API's thread (`Checked`: a bad one never reaches the loop), then run on the loop's,
        and `then` after it, whatever it did (a new view: a job just started is listed by
        the next GET, not the next tick)."""
        return {
            path: {m: h if m == "GET" else self._posted(h, then) for m, h in methods.items()}
            for path, methods in routes.items()
        }

    def _posted(self, handler: Handler, then: Callable[[], object]) -> Handler:
        def run(request: Request) -> object:
            step = prepared(handler, request)

            def command() -> object:
                try:
                    return step()
                finally:
                    then()

            return self.call(command)

        return run
