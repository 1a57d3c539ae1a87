"""Collective construction, checked: every rank of a group must build the same instances in the same
order. A rank that builds alone would wait in the first collective for ever; instead each
construction first checks in through the group's store, with what it builds, and waits (bounded) for
every rank to check in to the same construction. A rank missing when the bound runs out, or one that
builds something else, is named in the error: no hang without a message, and no instance paired with
another rank's different one.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import defaultdict

_log = logging.getLogger("lamport_mhc")

# Constructions this process began, per group (its global ranks): the n-th on every rank pair up.
_begun: dict[tuple[int, ...], int] = defaultdict(int)
NOTICE_S = 30.0  # log a line about the ranks still missing every this long


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _arrived(store, keys: list[str], seconds: float) -> bool:
    """Whether every key is set within ``seconds`` (the store's own wait: no polling)."""
    import torch.distributed as dist

    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except dist.DistStoreError:
        return False
    return True


def check_in(group, what: str, timeout_s: float | None) -> None:
    """Announce this rank's construction ``what`` (a description of the build: every rank must give
    the same) and wait until every rank of ``group`` has announced its own, the same one. Raises
    RuntimeError naming the ranks that did not arrive within ``timeout_s`` (None: wait for ever) or
    that announced another build."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return
    index = _begun[ranks]
    _begun[ranks] += 1
    me = dist.get_rank()
    prefix = f"lamport_mhc/build/{','.join(map(str, ranks))}/{index}/"
    store = _store()
    store.set(prefix + str(me), what)
    keys = {rank: prefix + str(rank) for rank in ranks}
    started = time.monotonic()
    deadline = None if timeout_s is None else started + timeout_s
    while True:
        left = NOTICE_S if deadline is None else min(NOTICE_S, deadline - time.monotonic())
        if _arrived(store, list(keys.values()), max(left, 0.001)):
            break
        missing = [rank for rank, key in keys.items() if not store.check([key])]
        if deadline is not None and time.monotonic() >= deadline:
            raise RuntimeError(
                f"rank {me}: construction #{index} on the group of ranks {list(ranks)} ({what}): ranks {missing} did "
                f"not begin it within {timeout_s:g} s. Construction is collective: every rank of the group must build "
                f"the same instances in the same order (construction_timeout_s bounds this wait)")
        _log.warning("rank %d: construction #%d (%s) still waits for ranks %s after %.0f s", me, index, what, missing,
                     time.monotonic() - started)
    built = dict(zip(keys, store.multi_get(list(keys.values()))))
    others = {rank: value.decode() for rank, value in built.items() if rank != me}
    differ = {rank: theirs for rank, theirs in others.items() if theirs != what}
    if differ:
        listed = "; ".join(f"rank {rank}: {theirs}" for rank, theirs in sorted(differ.items()))
        raise RuntimeError(f"rank {me}: construction #{index} on the group of ranks {list(ranks)} builds {what}, but "
                           f"{listed}. Every rank must build the same instances in the same order")
