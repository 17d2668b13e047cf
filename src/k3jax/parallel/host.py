"""The host CPU as XLA devices: how many cores, splitting it into N devices, and the thread pool that makes
collectives between such devices safe.

XLA:CPU runs every device's share of a multi-device program on one client thread pool of
``max(NPROC or the core count, devices)`` threads. A launch holds a thread per device while it waits for that
device's previous run to finish, and a running program holds a thread per device until its collectives complete,
so with as many threads as devices the next launch can take the threads the current run's last devices need: the
program deadlocks in its first all-reduce (seen as "Expected 4 threads to join the rendezvous" and a hang; it
reproduced in 2 of 2 runs of a 300-step psum loop on 8 devices, 2 cores). Twice the device count cannot run out:
at most one launch waits while one run executes. :func:`guard_collective_threads` asks for four times.
"""

from __future__ import annotations

import os
import re

_FLAG = "--xla_force_host_platform_device_count"


def host_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def forced_device_count(env: dict | None = None) -> int | None:
    """The host device count ``XLA_FLAGS`` in ``env`` (default ``os.environ``) asks for, or None."""
    env = os.environ if env is None else env
    m = re.search(_FLAG + r"=(\d+)", env.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else None


def guard_collective_threads(env: dict | None = None) -> int | None:
    """With several host devices forced in ``env``'s ``XLA_FLAGS``, make sure ``NPROC`` (the size XLA gives its CPU
    client's thread pools) is at least twice the device count, so that collectives between the devices cannot run
    out of threads (see the module docstring): unset or smaller, it becomes ``max(cores, 4 × devices)``; a larger
    value is kept. Takes effect if set before JAX starts its CPU backend; returns the ``NPROC`` now in ``env``
    (None: unset, with nothing to guard)."""
    env = os.environ if env is None else env
    count = forced_device_count(env)
    cur = env.get("NPROC", "")
    if count is not None and count > 1 and not (cur.isdigit() and int(cur) >= 2 * count):
        env["NPROC"] = str(max(host_cores(), 4 * count))
    return int(env["NPROC"]) if env.get("NPROC", "").isdigit() else None


def host_device_flag(count: int | None = None, env: dict | None = None) -> int:
    """Ask XLA for ``count`` CPU devices (default: the cores this process may use) by adding
    ``--xla_force_host_platform_device_count`` to ``XLA_FLAGS`` in ``env`` (default ``os.environ``), unless the flag
    is already there, and size the thread pool their collectives need (:func:`guard_collective_threads`). It only
    takes effect if JAX's backends have not started yet in that process. Returns the device count the flags now
    ask for."""
    env = os.environ if env is None else env
    have = forced_device_count(env)
    if have is None:
        have = host_cores() if count is None else count
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_FLAG}={have}".strip()
    guard_collective_threads(env)
    return have
