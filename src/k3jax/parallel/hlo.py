"""Collectives read off a compiled XLA program (``jax.jit(f).lower(...).compile().as_text()``): which ones, and
the bytes of their operands — what tests and benchmarks check communication by, instead of a formula."""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(sorted(COLLECTIVES, key=len, reverse=True)) + r")(-start)?\((.*)$")


def shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every ``dtype[d0,d1,…]`` in ``text``, in order."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]


def nbytes(shape: tuple[str, tuple[int, ...]]) -> int:
    return _DTYPE_BYTES[shape[0]] * math.prod(shape[1])


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+[\w\-]+\(")
_NAME = re.compile(r"%([\w.\-]+)")


def collectives(hlo_text: str) -> list[dict]:
    """One entry per collective instruction (async pairs counted once, at their ``-start``): ``op``, the result
    and operand shapes, and ``operand_bytes`` / ``result_bytes``. Operands printed by name are looked up in the
    module's instruction definitions."""
    defs = {}
    for line in hlo_text.splitlines():
        d = _DEF.match(line)
        if d:
            defs[d.group(1)] = shapes(d.group(2))
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        result, op, _, rest = m.groups()
        operands = rest.split("), ", 1)[0]
        res = shapes(result)
        ops = shapes(operands) or [s for name in _NAME.findall(operands) for s in defs.get(name, [])]
        out.append({"op": op, "result": res, "operands": ops, "result_bytes": sum(map(nbytes, res)),
                    "operand_bytes": sum(map(nbytes, ops)), "group_size": _group_size(line)})
    return out


def _group_size(line: str) -> int | None:
    """Devices per replica group (``replica_groups={{0,1},{2,3}}`` or the iota form ``[2,2]<=[4]``); None when
    the instruction names none (e.g. a collective-permute's pairs)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return int(m.group(2)) if m else None


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Operand bytes per collective kind (``{"all-gather": …, …}``; kinds absent from the program are left out, as
    are collectives over groups of one device, which move nothing)."""
    tot: dict[str, int] = {}
    for c in collectives(hlo_text):
        if c["group_size"] == 1:
            continue
        tot[c["op"]] = tot.get(c["op"], 0) + c["operand_bytes"]
    return tot
