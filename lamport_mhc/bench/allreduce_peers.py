"""The plain all-reduces of torch an engine already has: NCCL and PyTorch symmetric memory's
one-shot and two-shot. Each peer reduces a bf16 [M, H] contribution into a buffer it owns, sized
once per hidden size for the sweep's largest M, and returns the reduced rows."""

from __future__ import annotations

import torch


class NcclAllReduce:
    name = "nccl_all_reduce"

    def __init__(self, coll, capacity: int, hidden: int, device):
        self.group = coll.group
        self.reduced = torch.empty((capacity, hidden), dtype=torch.bfloat16, device=device)

    def skip_reason(self, m: int) -> str | None:
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        reduced = self.reduced[:x.shape[0]]
        reduced.copy_(x)
        dist.all_reduce(reduced, group=self.group)
        return reduced

    def after_capture(self) -> None:
        pass

    def close(self) -> None:
        pass


class SymmetricStage:
    """One symmetric-memory buffer per hidden size that the symmetric-memory all-reduces read their
    input from (they need it there: the contribution is copied in first)."""

    def __init__(self, coll, capacity: int, hidden: int, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty((capacity, hidden), dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(self.buffer, coll.group)
        self.group_name = coll.group.group_name
        self.out = torch.empty((capacity, hidden), dtype=torch.bfloat16, device=device)


class OneShotAllReduce:
    name = "one_shot_all_reduce"

    def __init__(self, stage: SymmetricStage):
        self.stage = stage

    def skip_reason(self, m: int) -> str | None:
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        staged, out = self.stage.buffer[:m], self.stage.out[:m]
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.stage.group_name, out)

    def after_capture(self) -> None:
        pass

    def close(self) -> None:
        pass


class TwoShotAllReduce(OneShotAllReduce):
    """``torch.ops.symm_mem.two_shot_all_reduce_``: reduce-scatter then all-gather, in place."""

    name = "two_shot_all_reduce"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.stage.buffer[:x.shape[0]]
        staged.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.stage.group_name)
