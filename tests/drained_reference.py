"""The program with a drain as it was before it skipped plans (ringtrain.plan at 298fd12,
``_optimal_groups_drained``, verbatim but for its name): every plan kept so far is extended by
every group and each new front is sorted out of all of them. The reference that the faster
program must match plan for plan (tests/test_plan.py)."""

from __future__ import annotations

import numpy as np

from ringtrain.plan import CostFn, Interference, LinearCost, _Columns, _cost_array, _end, _last_group, _prefix


def drained_groups_extending_every_plan(ready: np.ndarray, sizes: np.ndarray, cost: CostFn, slow: Interference,
                                        drain: CostFn, counted: bool, tail: float = 0.0) -> list[tuple[int, int]]:
    """The prefix program with a drain (module docstring): a plan of a prefix has two ends, its
    last push's and its last pull's, and the whole plan's end is non-decreasing in both, so a
    prefix keeps every plan that no other of it beats in both (a Pareto front): exact. The front
    holds one plan per prefix or a few with the simulator's server costs (10-20 where pulls are
    slower than pushes), but can grow with the layers where a drain's start-up dominates (290
    per prefix at 300 equal layers, the program then about cubic). Interference as in the other
    programs: ``counted`` (a per-message cost, up to ``_DRAINED_COUNT_LIMIT`` layers), one pass per group
    count (a plan of g groups extends the fronts of g - 1) until the lower bounds of
    :func:`_optimal_groups_counted`, the last group's drain added, cannot beat the best; else one
    pass that plans without the per-message cost (charged by the timing). The whole plan's by
    :func:`_last_group`."""
    n = len(sizes)
    if n == 0:
        return []
    prefix = _prefix(sizes)
    bytes_delay = slow.per_byte * prefix  # the same expressions as _evaluate's
    end0 = float(ready[-1])
    table = drain_table = None
    if counted:  # every candidate group's cost and drain, once for every pass (row j: the groups i..j-1)
        rows, cols = np.tril_indices(n + 1, -1)
        nbytes = prefix[rows] - prefix[cols]
        table, drain_table = _cost_array(cost, nbytes), _cost_array(drain, nbytes)
        cheapest = float(table.min())
    # The plans kept by one pass, all prefixes together in order of prefix: push end, pull end,
    # the prefix covered, the first layer of the last group, the plan extended (an index into
    # the pass before; a pass without counts extends its own plans).
    root = dict(push=np.zeros(1), pull=np.zeros(1), covers=np.zeros(1, dtype=np.int64),
                first=np.zeros(1, dtype=np.int64), parent=np.full(1, -1, dtype=np.int64))
    passes = [root]
    best_end, best_pass, best_index = np.inf, 0, 0
    g = 1  # the count of groups of the plans this pass makes (every count at once without per_message)
    while True:
        before = passes[-1]
        made = _Columns(root, keep=not counted)
        delay_messages = slow.per_message * (g - 1)
        for j in range(1, n + 1):
            if counted:  # the plans of g - 1 groups over prefixes < j
                upto = int(np.searchsorted(before["covers"], j))
                e_before, q_before, i = before["push"][:upto], before["pull"][:upto], before["covers"][:upto]
            else:  # every plan kept so far
                e_before, q_before, i = (made.view(key) for key in ("push", "pull", "covers"))
            if not len(i):
                continue
            if table is None:
                nbytes = prefix[j] - prefix[:j]
                costs, drains = _cost_array(cost, nbytes)[i], _cost_array(drain, nbytes)[i]
            else:
                row = slice(j * (j - 1) // 2, j * (j + 1) // 2)
                costs, drains = table[row][i], drain_table[row][i]
            delay = delay_messages + bytes_delay[i]
            # Slowed until backward's end as known at the launch (_evaluate's expressions).
            until = end0 + (slow.per_message * g + bytes_delay[j]) if j < n else end0 + delay
            e = _end(np.maximum(ready[j - 1] + delay, e_before), costs, until, slow.comm_slowdown)
            q = np.maximum(q_before, e) + drains
            if j == n and tail:  # plans of the whole: the best by the later of its end and backward's
                kept = np.array([_last_group(q, end0 + delay, tail)])
            else:  # by push end, then pull end: kept where the pull end is a new low
                order = np.lexsort((q, e))
                lows = np.minimum.accumulate(np.concatenate(([np.inf], q[order][:-1])))
                kept = order[q[order] < lows]
            made.append(push=e[kept], pull=q[kept], covers=np.full(len(kept), j), first=i[kept], parent=kept)
        this = {key: made.view(key) for key in root}
        passes.append(this)
        whole = np.flatnonzero(this["covers"] == n)
        if len(whole):
            backward = end0 + (delay_messages + bytes_delay[this["first"][whole]])  # (its last group's delay)
            pick = _last_group(this["pull"][whole], backward, tail)
            k = int(whole[pick])
            end = max(float(this["pull"][k]), float(backward[pick]) + tail)
            if end < best_end:
                best_end, best_pass, best_index = end, len(passes) - 1, k
        if not counted or g == n:
            break
        g += 1
        # Lower bounds on the end of any plan of g or more groups (they grow with g): its last
        # group's push and pull, after backward's end delayed by g - 1 launches and the bytes
        # before it; the g pushes on their stream (a margin of 1e-9 for the rounding of the sum).
        row = slice(n * (n - 1) // 2, n * (n + 1) // 2)  # the groups i..n-1
        last = np.min(ready[-1] + (slow.per_message * (g - 1) + bytes_delay[:n]) + table[row] + drain_table[row])
        chain = g * cost.alpha + cost.per_byte * prefix[n] if isinstance(cost, LinearCost) else g * cheapest
        if max(last, chain * (1.0 - 1e-9)) >= best_end:
            break
    # Back from the best plan of the whole, pass by pass (or within the one pass).
    groups = []
    p, index = best_pass, best_index
    while passes[p]["covers"][index] > 0:
        plan = passes[p]
        groups.append((int(plan["first"][index]), int(plan["covers"][index]) - 1))
        index = int(plan["parent"][index])
        if counted:
            p -= 1
    return groups[::-1]
