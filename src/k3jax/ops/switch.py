"""``lax.switch`` whose backward runs only the taken branch: choosing a small static layout at run time (MoonEP's
fetch slots, the grouped matmul's padded capacity) without paying for the residuals of the layouts not taken."""

from __future__ import annotations

import jax


def switch_recompute(index: jax.Array, branches, ints: tuple, floats: tuple):
    """``lax.switch(index, branches, ints, floats)`` for branches returning ``(y, aux)`` (``aux`` integer, no
    cotangent), differentiable in ``floats``; its backward runs the VJP of the taken branch only, recomputing
    that branch's forward. (``lax.switch``'s own VJP keeps the residuals of every branch — zeros, at full size,
    for those not taken — which is what choosing a small layout at run time over a worst-case one avoids.)
    ``ints``: integer operands. Collectives inside a branch need ``index`` equal on every rank."""

    @jax.custom_vjp
    def run(index, ints, floats):
        return jax.lax.switch(index, branches, ints, floats)

    def fwd(index, ints, floats):
        return run(index, ints, floats), (index, ints, floats)

    def bwd(res, ct):
        index, ints, floats = res

        def pull(branch):
            return lambda ct, ints, floats: jax.vjp(lambda fl: branch(ints, fl), floats, has_aux=True)[1](ct)[0]

        return None, None, jax.lax.switch(index, [pull(b) for b in branches], ct[0], ints, floats)

    run.defvjp(fwd, bwd)
    return run(index, ints, floats)
