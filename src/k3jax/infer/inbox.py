"""How other threads reach the scheduler thread: :class:`Inbox` (submissions, cancellations and calls, queued) and
:class:`Hooks` (callbacks registered from any thread, called on the scheduler thread).

The scheduler thread owns every mutable engine structure; the only state another thread touches is the inbox's
own (under its lock): the queued items and two counts — requests not yet finished (:attr:`Inbox.live`) and requests
waiting for a slot (:attr:`Inbox.waiting`, what ``max_queue`` bounds).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from typing import Callable, Iterator

from k3jax.infer.requests import QueueFull, Request


class Inbox:
    """Items for the scheduler thread: ``("submit", request)``, ``("cancel", request or id, reason)``, ``("call",
    fn, future)``. ``max_queue``: waiting requests (queued or not yet admitted) before :meth:`submit` refuses."""

    def __init__(self, max_queue: int):
        self.max_queue = int(max_queue)
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition(threading.RLock())
        self.live = 0            # submitted, not finished
        self.waiting = 0         # submitted (or preempted), not admitted, not finished
        self.accepting = True
        self.closing = False

    def submit(self, req: Request) -> None:
        with self._cv:
            if not self.accepting:
                raise QueueFull("the server is shutting down", retry_after=5.0)
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting (max_queue); retry later")
            self.live += 1
            self.waiting += 1
            self._items.append(("submit", req))
            self._cv.notify()

    def cancel(self, req: Request | str, reason: str = "abort") -> None:
        with self._cv:
            self._items.append(("cancel", req, reason))
            self._cv.notify()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._items.append(("call", fn, fut))
            self._cv.notify()
        return fut

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Submissions made inside reach the scheduler together, in one step."""
        with self._cv:
            yield

    # ------------------------------------------------------------------------------ the scheduler thread's side
    def drain(self) -> list:
        with self._cv:
            items = list(self._items)
            self._items.clear()
        return items

    def wait(self, busy: bool, timeout: float = 0.5) -> None:
        """Block until there is something to do: items queued, the scheduler ``busy``, or closing."""
        with self._cv:
            if not (self._items or busy or self.closing):
                self._cv.wait(timeout)

    def admitted(self) -> None:
        with self._cv:
            self.waiting -= 1

    def requeued(self) -> None:
        with self._cv:
            self.waiting += 1

    def finished(self, was_waiting: bool) -> None:
        with self._cv:
            self.live -= 1
            self.waiting -= int(was_waiting)

    def close(self) -> None:
        with self._cv:
            self.closing = True
            self._cv.notify_all()


class Hooks:
    """Callbacks added and removed from any thread, called from the scheduler thread (a copy-on-write tuple: a call
    in progress sees the hooks as they were when it started)."""

    def __init__(self):
        self._fns: tuple = ()
        self._lock = threading.Lock()

    def append(self, fn: Callable) -> None:
        with self._lock:
            self._fns = self._fns + (fn,)

    def remove(self, fn: Callable) -> None:
        with self._lock:
            fns = list(self._fns)
            fns.remove(fn)
            self._fns = tuple(fns)

    def __iter__(self):
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)


__all__ = ["Inbox", "Hooks"]
