"""The few collective steps the benchmark's setup needs (agreeing on a result, a barrier), behind
one small object so the peers' setup can run against a stand-in on CPU."""

from __future__ import annotations


class Collective:
    """A torch.distributed process group: its size, this rank, object all-gather and barrier."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def all_gather_object(self, obj) -> list:
        import torch.distributed as dist

        gathered: list = [None] * self.tp
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


def attempt(fn) -> str | None:
    """Run ``fn``; None when it returned, else the error as one line."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the caller reports it as a skipped peer
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def agree(coll: Collective, error: str | None) -> str | None:
    """Every rank's outcome of the same step; the first failure (naming its rank), or None when all
    succeeded. A step that failed anywhere is then skipped everywhere, so the ranks' later
    collective calls stay in step."""
    for rank, outcome in enumerate(coll.all_gather_object(error)):
        if outcome is not None:
            return f"rank {rank}: {outcome}"
    return None
