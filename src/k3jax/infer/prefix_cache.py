"""A KDA-aware prefix cache: the host-side index (hash chain, nodes, reference-counted pages, LRU under one budget).

A softmax layer can resume from any cached prefix; a KDA layer only where its recurrent state was saved. So:

* **Hash chain.** Token ids are hashed in blocks of ``block`` tokens (512, independent of the MLA page size):
  ``h_b = blake2b(h_{b−1} ‖ ids of block b ‖ digests of non-token inputs placed in block b)``. One key names a whole
  prefix, so equal keys mean equal computations.
* **Nodes.** A :class:`PrefixNode` per cached block boundary ``L = b·block`` holds references on the MLA pages of
  tokens ``[0, L)`` (shared with its ancestors and with every request that reuses them) and, at sparse boundaries,
  a :class:`KDACheckpoint`: every KDA layer's state and conv window after ``L`` tokens and the next-token logits
  there (so a prompt that is entirely cached needs no prefill at all). Every node's parent is cached; a node's
  pages are never written after it is created (the scheduler copies a partial page before anyone writes past it).
* **Lookup** (:meth:`PrefixCache.lookup`) in two phases: the longest run of cached blocks from the start, then
  the deepest node within it that has a checkpoint. A node carries its pages and its checkpoint together, so a
  lookup can never find a checkpoint whose pages are gone.
* **Memory** (:meth:`PrefixCache.held_bytes`): checkpoints and the pages the nodes reference share one budget;
  LRU eviction takes unpinned leaves only (a node in use by a running request is pinned, and a node with
  children is not a leaf), so the chain from the root stays whole. Evicting a node drops its checkpoint and its
  page references in one step; a page returns to the free list when its last holder lets go.

The scheduler uses the index through :class:`k3jax.infer.prefix_policy.PrefixPolicy` (lookup on admission,
registration after a step); the model runner saves and restores checkpoints and copies pages. This module never
touches device memory and imports no JAX.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from k3jax.infer.slots import PageAllocator

_ROOT = b"k3jax-prefix-v1"


def extend_hashes(hashes: list[bytes], tokens: Sequence[int], block: int,
                  content_keys: Sequence[tuple[int, bytes]] = ()) -> list[bytes]:
    """``hashes`` extended with the chain hash of every complete block of ``tokens`` past ``len(hashes)`` blocks.
    ``content_keys``: ``(position, digest)`` of inputs that are not token ids (an image's content at its first
    placeholder token); each is hashed into the block holding its position."""
    arr = np.asarray(tokens, dtype="<i4")
    h = hashes[-1] if hashes else _ROOT
    for b in range(len(hashes), len(arr) // block):
        m = hashlib.blake2b(h, digest_size=16)
        m.update(arr[b * block:(b + 1) * block].tobytes())
        for pos, digest in content_keys:
            if b * block <= pos < (b + 1) * block:
                m.update(int(pos).to_bytes(8, "little"))
                m.update(digest)
        h = m.digest()
        hashes.append(h)
    return hashes


def block_hashes(tokens: Sequence[int], block: int, content_keys: Sequence[tuple[int, bytes]] = ()) -> list[bytes]:
    """The chain hash of each complete ``block``-token block of ``tokens`` (see :func:`extend_hashes`)."""
    return extend_hashes([], tokens, block, content_keys)


@dataclass(eq=False)
class KDACheckpoint:
    """Every KDA layer's state and conv windows after a boundary (``rows``: one batch-1 ``KDACache`` per KDA layer,
    on device) and the next-token logits there (``logits [V]``)."""

    rows: tuple
    logits: Any
    nbytes: int


@dataclass(eq=False)
class PrefixNode:
    key: bytes
    parent: "PrefixNode | None"
    length: int                          # tokens covered: a multiple of the block
    pages: list[int]                     # MLA pages of tokens [0, length), in order
    checkpoint: KDACheckpoint | None = None
    children: int = 0
    pins: int = 0                        # running requests that started from this node
    last_use: int = 0


class PrefixCache:
    """The index over a :class:`PageAllocator` (see the module docstring). ``budget`` bytes bound checkpoints plus
    the pages nodes reference (``page_bytes`` each); ``stride``: inside a prompt, a checkpoint every ``stride``
    blocks (besides the prompt's last boundary)."""

    def __init__(self, alloc: PageAllocator, *, block: int, page_size: int, page_bytes: int, budget: int,
                 stride: int):
        if block < 16 or block % 16:
            raise ValueError(f"prefix block: expected a multiple of 16 tokens, got {block}")
        if stride < 1:
            raise ValueError(f"prefix stride: expected ≥ 1 blocks, got {stride}")
        self.alloc, self.block, self.page_size, self.page_bytes = alloc, block, page_size, page_bytes
        self.budget, self.stride = int(budget), int(stride)
        self.nodes: dict[bytes, PrefixNode] = {}
        self.page_users: collections.Counter = collections.Counter()   # page → nodes referencing it
        self.checkpoint_bytes = 0
        self._clock = itertools.count(1)
        self.stats = {"lookups": 0, "hits": 0, "queried_tokens": 0, "hit_tokens": 0, "evictions": 0,
                      "checkpoints_saved": 0, "verified": 0, "verify_failures": 0}

    # ------------------------------------------------------------------------------------------ queries
    @property
    def checkpoints(self) -> int:
        return sum(n.checkpoint is not None for n in self.nodes.values())

    def held_bytes(self) -> int:
        """Checkpoint bytes plus the bytes of every page a node references (counted once)."""
        return self.checkpoint_bytes + len(self.page_users) * self.page_bytes

    def node(self, key: bytes) -> PrefixNode | None:
        """The cached node of the prefix ``key`` names, or None."""
        return self.nodes.get(key)

    def count(self, stat: str, n: int = 1) -> None:
        """Add ``n`` to the figure ``stat`` (``verified``, ``verify_failures``: the caller's checks)."""
        self.stats[stat] += n

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, PrefixNode | None]:
        """Two phases: ``k`` = the number of leading blocks cached (MLA pages present), then the deepest node among
        them with a KDA checkpoint (or None). Counts the lookup; the caller records the hit (:meth:`record`)."""
        k = 0
        while k < len(hashes) and hashes[k] in self.nodes:
            k += 1
        for j in range(k, 0, -1):
            node = self.nodes[hashes[j - 1]]
            if node.checkpoint is not None:
                return k, node
        return k, None

    def record(self, queried: int, hit: int) -> None:
        self.stats["lookups"] += 1
        self.stats["queried_tokens"] += queried
        self.stats["hit_tokens"] += hit
        self.stats["hits"] += hit > 0

    def save_points(self, n_tokens: int, start: int, shared_blocks: int) -> frozenset:
        """Where a prefill of ``n_tokens`` tokens from ``start`` saves checkpoints: every ``stride``-th boundary, the
        last boundary of the sequence, and the branch point — the end of the ``shared_blocks`` blocks other
        sequences already cached without a checkpoint there (so the next request sharing them hits)."""
        B = self.block
        pts = {b * B for b in range(self.stride, n_tokens // B + 1, self.stride)}
        pts.add((n_tokens // B) * B)
        pts.add(shared_blocks * B)
        return frozenset(p for p in pts if start < p <= n_tokens)

    # ------------------------------------------------------------------------------------------ updates
    def touch(self, node: PrefixNode) -> None:
        """Mark ``node`` and its ancestors used now (LRU)."""
        t = next(self._clock)
        while node is not None:
            node.last_use = t
            node = node.parent

    def pin(self, node: PrefixNode) -> None:
        node.pins += 1
        self.touch(node)

    def unpin(self, node: PrefixNode) -> None:
        if node.pins > 0:
            node.pins -= 1

    def insert(self, key: bytes, parent: PrefixNode | None, length: int, pages: Sequence[int], *,
               take: Sequence[int] = ()) -> PrefixNode:
        """A node for the prefix ``key`` of ``length`` tokens over ``pages``, child of ``parent`` (cached; None for
        the first block). The node takes one reference on each page: a new one, except for the pages in ``take``,
        whose caller hands its own reference over."""
        if key in self.nodes:
            raise KeyError(f"prefix node of {length} tokens: already cached")
        if (parent is None) != (length == self.block) or (parent is not None and (
                self.nodes.get(parent.key) is not parent or parent.length != length - self.block)):
            raise ValueError(f"prefix node of {length} tokens: its parent must be the cached node of "
                             f"{length - self.block} tokens")
        handed = set(take)
        self.alloc.retain([p for p in pages if p not in handed])
        for p in pages:
            self.page_users[p] += 1
        node = PrefixNode(key, parent, length, list(pages))
        if parent is not None:
            parent.children += 1
        self.nodes[key] = node
        self.touch(node)
        return node

    def attach(self, node: PrefixNode, ckpt: KDACheckpoint) -> None:
        """Give ``node`` its KDA checkpoint (a node keeps the first one it gets)."""
        if node.checkpoint is None:
            node.checkpoint = ckpt
            self.checkpoint_bytes += ckpt.nbytes
            self.stats["checkpoints_saved"] += 1

    def drop_checkpoint(self, node: PrefixNode) -> None:
        """Free ``node``'s checkpoint; the node (its pages, the chain) stays."""
        if node.checkpoint is not None:
            self.checkpoint_bytes -= node.checkpoint.nbytes
            node.checkpoint = None

    def _remove(self, node: PrefixNode) -> None:
        del self.nodes[node.key]
        self.drop_checkpoint(node)
        for p in node.pages:
            self.page_users[p] -= 1
            if self.page_users[p] == 0:
                del self.page_users[p]
        self.alloc.release(node.pages)
        node.pages = []
        if node.parent is not None:
            node.parent.children -= 1
        self.stats["evictions"] += 1

    def discard(self, node: PrefixNode) -> int:
        """Remove ``node`` and every node below it (a checkpoint found wrong: nothing built on it is kept), pinned
        or not. Returns the number removed."""
        doomed = {node.key}
        changed = True
        while changed:
            changed = False
            for n in self.nodes.values():
                if n.key not in doomed and n.parent is not None and n.parent.key in doomed:
                    doomed.add(n.key)
                    changed = True
        for n in sorted((self.nodes[k] for k in doomed if k in self.nodes), key=lambda n: -n.length):
            self._remove(n)
        return len(doomed)

    def evictable(self) -> list[PrefixNode]:
        """Unpinned leaves, least recently used first."""
        return sorted((n for n in self.nodes.values() if n.children == 0 and n.pins == 0), key=lambda n: n.last_use)

    def evict_one(self) -> bool:
        """Evict the least recently used unpinned leaf; False when there is none."""
        cands = self.evictable()
        if not cands:
            return False
        self._remove(cands[0])
        return True

    def reclaimable_pages(self) -> int:
        """Pages that evicting nodes would free: held by no running request and by no node that cannot be evicted (a
        pinned node, or an ancestor of one)."""
        blocked = set()
        for n in self.nodes.values():
            if n.pins > 0:
                while n is not None and n.key not in blocked:
                    blocked.add(n.key)
                    n = n.parent
        users: collections.Counter = collections.Counter()
        for n in self.nodes.values():
            if n.key not in blocked:
                users.update(n.pages)
        return sum(1 for p, k in users.items() if self.alloc.refs[p] == k)

    def make_room(self, n_pages: int) -> bool:
        """Evict LRU leaves until ``n_pages`` pages are free; evicts nothing when eviction cannot free enough (the
        pages are held by running requests). True when the pages are free."""
        if self.alloc.free >= n_pages:
            return True
        if self.alloc.free + self.reclaimable_pages() < n_pages:
            return False
        while self.alloc.free < n_pages and self.evict_one():
            pass
        return self.alloc.free >= n_pages

    def enforce_budget(self) -> None:
        """Evict LRU leaves while the cache holds more than its budget."""
        while self.held_bytes() > self.budget and self.evict_one():
            pass

    def clear(self) -> None:
        """Evict every unpinned node (pinned ones and their ancestors stay)."""
        while self.evict_one():
            pass

    # ------------------------------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the index's invariants (tests call it after every step): each node's parent is cached and one
        block shorter, children counts, page coverage, page reference counts, checkpoint bytes."""
        kids: collections.Counter = collections.Counter()
        users: collections.Counter = collections.Counter()
        ck = 0
        for key, n in self.nodes.items():
            assert n.key == key
            assert n.length % self.block == 0 and n.length > 0, n.length
            if n.parent is None:
                assert n.length == self.block, f"node of {n.length} tokens has no parent"
            else:
                assert self.nodes.get(n.parent.key) is n.parent, f"node of {n.length} tokens: parent evicted"
                assert n.parent.length == n.length - self.block
                kids[n.parent.key] += 1
            assert len(n.pages) == -(-n.length // self.page_size), (n.length, len(n.pages))
            users.update(n.pages)
            ck += n.checkpoint.nbytes if n.checkpoint is not None else 0
        for key, n in self.nodes.items():
            assert n.children == kids[key], f"node of {n.length} tokens: children {n.children} != {kids[key]}"
        assert users == self.page_users, "page users out of date"
        for p, u in users.items():
            assert self.alloc.refs[p] >= u, f"page {p}: {u} nodes hold it but its reference count is {self.alloc.refs[p]}"
        assert ck == self.checkpoint_bytes, (ck, self.checkpoint_bytes)

    def snapshot(self) -> dict:
        s = dict(self.stats)
        s.update(nodes=len(self.nodes), checkpoints=self.checkpoints, checkpoint_bytes=self.checkpoint_bytes,
                 cached_pages=len(self.page_users), held_bytes=self.held_bytes(), budget_bytes=self.budget,
                 hit_rate=self.stats["hit_tokens"] / max(1, self.stats["queried_tokens"]))
        return s


__all__ = ["PrefixCache", "PrefixNode", "KDACheckpoint", "block_hashes", "extend_hashes"]
