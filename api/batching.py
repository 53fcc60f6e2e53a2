"""Choosing which queued groups make one batch: exactly `target` sequences, groups never split.

Among all subsets of the queued groups whose sizes add up to `target`, `pick_exact` returns the
one that is first in queue order (compare the sorted positions lexicographically): the oldest
group is served whenever some exact batch can include it, then the next oldest, and so on.

Reachable sums are kept as bitsets in Python ints (bit s set: sum s is reachable), so one call
costs O(len(sizes) * target / 64) word operations.
"""

from __future__ import annotations

from collections.abc import Sequence


def pick_exact(sizes: Sequence[int], target: int) -> list[int] | None:
    """Positions (ascending) of the queue-order-first subset of `sizes` summing to `target`.

    Returns None when no subset adds up to exactly `target`. Sizes above `target` or below 1
    are never picked.
    """
    if target < 1:
        raise ValueError(f"target={target} must be at least 1")
    keep = (1 << (target + 1)) - 1
    # reach[i]: sums reachable with groups i.. (the empty subset gives sum 0).
    reach = [0] * (len(sizes) + 1)
    reach[-1] = 1
    for i in range(len(sizes) - 1, -1, -1):
        size = sizes[i]
        shifted = reach[i + 1] << size if 1 <= size <= target else 0
        reach[i] = (reach[i + 1] | shifted) & keep
    if not reach[0] >> target & 1:
        return None

    chosen: list[int] = []
    remaining = target
    for i, size in enumerate(sizes):
        if remaining == 0:
            break
        if 1 <= size <= remaining and reach[i + 1] >> (remaining - size) & 1:
            chosen.append(i)
            remaining -= size
    return chosen
