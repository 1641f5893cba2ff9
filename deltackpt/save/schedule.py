"""The shape of a chain: which committed step each save between two full steps is coded against.

A writer makes a full step every ``full_every`` saves, and each save in between is a delta on
one step of that *group*: its *reference*. Restoring a step decodes its full step and every
delta on the way from it (the step's *depth*), so the depth bounds a restore's time. A delta's
size grows with how far behind its reference is: a weight's residual spreads as the optimizer
moves it (by ``d**a`` over ``d`` saves, ``a`` between 1/2 for noise and 1 for drift), so its
coded bits grow by ``a * log2(d)``, and a second moment's change grows too until it
decorrelates. A chain of deltas each on the save before it (distance 1) keeps deltas smallest
but makes the depth grow with every save; references that all point to the full step keep
the depth at 1 but their distance grows.

:func:`schedule` is the tree in between, as video codecs build their hierarchies of
references: every delta is coded against the latest save one level up (so a writer holds at
most one reconstruction per level), no save is deeper than ``depth``, and the sum over the
group of ``log2(distance to the reference)`` is the least such a tree can have. That sum is
the growth of the coded bits above those of distance-1 deltas for any ``a``, so the tree is
the same for every run. It is found by dynamic programming over the group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from deltackpt.format.checks import check_int

DEFAULT_FULL_EVERY = 256
DEFAULT_DEPTH = 8
# Groups up to this many saves get the least-cost tree (cubic in the length: 0.3 s at 256);
# a longer group is cut into runs of this many saves, each on a level-1 delta of the full step.
EXACT_SAVES = 256


@dataclass(frozen=True)
class Schedule:
    """The references of a group of ``full_every`` saves (position 0: the full step).

    ``depths[p]``: how many deltas restoring the save at position ``p`` decodes;
    ``reference(p)``: the position it is coded against (the latest one a level up);
    ``is_base[p]``: whether a later save of the group is coded against it (a writer keeps its
    reconstruction until then)."""

    full_every: int
    depth: int
    depths: tuple[int, ...]
    is_base: tuple[bool, ...]

    def reference(self, position: int) -> int:
        """The position the save at ``position`` (> 0) is coded against."""
        level = self.depths[position] - 1
        return next(p for p in range(position - 1, -1, -1) if self.depths[p] == level)


def schedule(full_every: int = DEFAULT_FULL_EVERY, depth: int = DEFAULT_DEPTH) -> Schedule:
    """The least-cost :class:`Schedule` of ``full_every`` saves restored through at most
    ``depth`` deltas (see the module doc). Raises :class:`~deltackpt.errors.ConfigError` naming
    the setting that is not a positive integer."""
    check_int(full_every, "full_every")
    check_int(depth, "depth")
    return _schedule(full_every, depth)


@functools.cache
def _schedule(full_every: int, depth: int) -> Schedule:
    depths = [0] * full_every
    if full_every <= EXACT_SAVES:
        depths = list(_least_cost_depths(full_every, depth))
    else:  # runs of EXACT_SAVES saves, each headed by a delta on the full step
        run = _least_cost_depths(EXACT_SAVES, depth - 1) if depth > 1 else None
        for head in range(1, full_every, EXACT_SAVES):
            for offset in range(min(EXACT_SAVES, full_every - head)):
                depths[head + offset] = 1 + (run[offset] if run is not None else 0)
    is_base = [False] * full_every
    latest = {0: 0}  # level -> the latest position at that level
    for p in range(1, full_every):
        is_base[latest[depths[p] - 1]] = True
        latest[depths[p]] = p
        for level in [lv for lv in latest if lv > depths[p]]:
            del latest[level]
    return Schedule(full_every, depth, tuple(depths), tuple(is_base))


def _least_cost_depths(n: int, depth: int) -> tuple[int, ...]:
    """Depths of positions ``0..n-1`` (0: the root) of the tree of :class:`Schedule`'s shape
    with the least sum of ``log2(distance to the reference)``.

    Under a node with ``h`` levels left, the ``m`` positions after it form blocks, each a child
    (one level down) followed by that child's own subtree. ``cost[h][m]`` is the least cost of
    such ``m`` positions; ``fill[m, p]`` that of ``m`` positions whose first child is ``p``
    after the node, choosing the first block's size ``s``:
    ``fill[m, p] = log2(p) + min_s(cost[h-1][s-1] + fill[m-s, p+s])``.
    """
    log2 = np.log2(np.arange(1, n + 1, dtype=np.float64))  # log2[p - 1]
    cost = np.full(n, np.inf)
    cost[0] = 0.0  # h = 0: no position fits below a leaf
    sizes: list[np.ndarray] = []  # per level: the first block's size, by (m, p)
    for _ in range(depth):
        fill = np.full((n, n + 1), np.inf)
        fill[0, :] = 0.0
        size = np.zeros((n, n + 1), np.int32)
        for m in range(1, n):
            first = np.arange(1, n - m + 1)  # p: where the first child may be
            s = np.arange(1, m + 1)[:, None]
            candidates = cost[s - 1] + fill[m - s, first[None, :] + s]
            best = np.argmin(candidates, axis=0)
            fill[m, first] = log2[first - 1] + candidates[best, np.arange(first.size)]
            size[m, first] = best + 1
        cost = fill[:, 1].copy()
        sizes.append(size)
    depths = [0] * n
    pending = [(0, n - 1, depth, 0)]  # (node, positions after it, levels left, its depth)
    while pending:
        node, m, levels, level = pending.pop()
        p = 1
        while m > 0:
            s = int(sizes[levels - 1][m, p])
            depths[node + p] = level + 1
            if s > 1:
                pending.append((node + p, s - 1, levels - 1, level + 1))
            p, m = p + s, m - s
    return tuple(depths)
