"""Rematerialization by name: what each decoder layer keeps for the backward pass (``--set remat=…``).

A policy has two parts. ``layer`` is a :mod:`jax.checkpoint_policies` policy applied to each whole decoder layer
(``None``: the layer is not checkpointed and XLA keeps whatever the backward reads). ``attnres`` recomputes every
AttnRes read (spec §6.1) in the backward — the K3 report's treatment (§5.2.2): the block representations are
produced once at their boundary layer and shared by every later read; a read's own work (the stacked fp32
candidates, their RMS, scores and softmax weights, ``[K+1, B, T, H]`` per read) is not kept but recomputed from the
blocks and the partial sum, so that a layer saves what the same layer with a plain residual saves.

Each layer names four activations (:func:`jax.ad_checkpoint.checkpoint_name`), which the ``offload`` policy moves
to host memory: ``mixer_in`` (the normed read entering KDA/MLA), ``mixer_out`` (its output), ``ffn_in`` (the
normed read entering the MLP/MoE) and ``ffn_out``.

In a scanned run of layers (``scan_layers=True``, :mod:`k3jax.nn.scan`) the AttnRes blocks sealed so far are the
scan's carry, which a plain scan keeps once per period. Under ``none`` that is what happens; under every other
policy the run's backward keeps only each period's input partial sum and the run's final blocks and recomputes
each period's forward before its VJP (inside which the layer policy applies as above).
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

LAYER_NAMES = ("mixer_in", "mixer_out", "ffn_in", "ffn_out")


@dataclass(frozen=True)
class RematPolicy:
    name: str
    layer: Callable | None       # jax.checkpoint policy of a whole decoder layer, or None (not checkpointed)
    attnres: bool                # AttnRes reads recomputed in the backward
    saves: str                   # what a layer keeps for the backward, in words


@functools.cache
def _policies() -> dict[str, RematPolicy]:
    cp = jax.checkpoint_policies
    return {p.name: p for p in (
        RematPolicy("none", None, False,
                    "everything the backward reads (XLA's choice), including each AttnRes read's stacked "
                    "candidates and softmax weights"),
        RematPolicy("attnres", None, True,
                    "everything the backward reads except the AttnRes reads' internals, recomputed from the "
                    "shared block representations and the partial sum (K3 report §5.2.2)"),
        RematPolicy("minimal", cp.dots_with_no_batch_dims_saveable, True,
                    "the layer's input and the outputs of its weight matmuls (projections, experts, router); "
                    "norms, gates, the KDA recurrence, attention and AttnRes reads recomputed"),
        RematPolicy("offload", cp.save_and_offload_only_these_names(
                        names_which_can_be_saved=[], names_which_can_be_offloaded=list(LAYER_NAMES),
                        offload_src="device", offload_dst="pinned_host"), True,
                    "the layer's input on the device; mixer_in, mixer_out, ffn_in and ffn_out in host memory "
                    "(pinned_host); the rest recomputed"),
        RematPolicy("full", cp.nothing_saveable, True,
                    "only the layer's input (the partial sum; the blocks are shared); the whole layer recomputed"),
    )}


REMAT_NAMES = ("none", "attnres", "minimal", "offload", "full")


def remat_policy(name: str | RematPolicy | None) -> RematPolicy:
    """The policy called ``name`` (None: ``none``), or a ValueError naming ``remat`` and the choices."""
    if isinstance(name, RematPolicy):
        return name
    pols = _policies()
    if name is None:
        return pols["none"]
    if name not in pols:
        raise ValueError(f"remat: expected one of {', '.join(REMAT_NAMES)}, got {name!r}")
    return pols[name]


_RESIDUAL = re.compile(r"^([a-z]+\d*)\[([\d,]*)\] (.*)$")
_DTYPES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
           "s64": 8, "u64": 8, "f64": 8}


def saved_residuals(fn: Callable, *args) -> list[tuple[str, int]]:
    """What the backward of ``fn(*args)`` keeps besides its arguments: ``(what, bytes)`` per residual, from
    :func:`jax.ad_checkpoint.print_saved_residuals` (JAX's own listing, read back from its text)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    out = []
    for line in buf.getvalue().splitlines():
        m = _RESIDUAL.match(line.strip())
        if m is None or m.group(3).startswith("from the argument"):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        out.append((m.group(3), int(np.prod(dims, dtype=np.int64)) * _DTYPES.get(m.group(1), 4)))
    return out


__all__ = ["RematPolicy", "remat_policy", "saved_residuals", "REMAT_NAMES", "LAYER_NAMES"]
