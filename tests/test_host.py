"""The host CPU split into XLA devices (k3jax.parallel.host): the client thread pool that keeps collectives between
simulated devices from deadlocking, and a multi-device program that deadlocked without it."""

import os
import subprocess
import sys
import textwrap

from conftest import xla_flags_for_tests
from k3jax.parallel.host import guard_collective_threads, host_cores, host_device_flag


def test_the_guard_sizes_nproc_from_the_forced_device_count():
    safe = str(max(host_cores(), 32))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert guard_collective_threads(env) == int(safe) and env["NPROC"] == safe
    small = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "2"}   # as some CI systems set it
    assert guard_collective_threads(small) == int(safe)                                  # too few: raised
    large = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "64"}
    assert guard_collective_threads(large) == 64                                         # enough: kept
    for plain in ({}, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, {"XLA_FLAGS": "--foo=1"}):
        assert guard_collective_threads(plain) is None and "NPROC" not in plain          # nothing to guard
    env = {}
    assert host_device_flag(2, env) == 2 and int(env["NPROC"]) == max(host_cores(), 8)


def test_psum_loop_on_8_host_devices_completes():
    # Two groups of 4 devices all-reducing in a jitted loop, launched back to back: with XLA's default pool on a
    # 2-core host (8 threads for 8 devices) this program deadlocked in its first all-reduce in 2 of 2 runs (the
    # next launch holds the threads the current run's last devices need; 5-6 threads wait in the rendezvous for
    # the others). Importing k3jax sizes the pool (NPROC) from XLA_FLAGS before the backend starts; a stuck
    # rendezvous aborts after 60 s instead of hanging.
    code = textwrap.dedent("""
        import os
        import jax, jax.numpy as jnp, numpy as np
        import k3jax  # noqa: F401
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("c", "d"))

        def body(x, w):
            outs = []
            for i in range(6):               # independent branches, three of them all-reducing over "c"
                y = jnp.tanh(x @ w[i])
                outs.append(jax.lax.psum(y, "c") if i % 2 == 0 else y @ w[i].T)
            return sum(outs)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("c", "d"), P()), out_specs=P("c", "d")))
        x, w = jnp.ones((4 * 128, 2 * 128)), jnp.full((6, 128, 128), 1e-3)
        for _ in range(150):
            x = f(x, w) * 1e-3
        print(os.environ["NPROC"], float(jnp.sum(x)))
    """)
    flags = xla_flags_for_tests("--xla_force_host_platform_device_count=8").replace(
        "terminate_timeout_seconds=300", "terminate_timeout_seconds=60")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    env.pop("NPROC", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    nproc, total = res.stdout.split()
    assert int(nproc) == max(host_cores(), 32) and float(total) == float(total)
