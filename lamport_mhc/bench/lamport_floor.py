"""``lamport-ar-floor``: the simplest one-kernel Lamport all-reduce (``kernels_triton.floor``) over
symmetric-memory mailboxes, the latency any LL design pays (tp > 1 only)."""

from __future__ import annotations

import torch

# One kernel that both publishes and polls relies on in-order block dispatch.
FLOOR_MAX_ROWS = 512


class LamportFloor:
    """Each program stores its slice of the row to every rank, polls its own mailbox until every
    rank's slice landed, sums in rank order and re-arms. No mHC, no norm."""

    def __init__(self, group, device, capacity: int, hidden: int):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from .. import layout

        self.tp, self.rank, self.hidden = dist.get_world_size(group), dist.get_rank(group), hidden
        self.capacity = capacity
        buffer = symm_mem.empty((layout.GENERATIONS, self.tp, capacity, hidden), dtype=torch.bfloat16,
                                device=device)
        buffer.view(torch.int16).fill_(layout.SENTINEL_INT16)
        handle = symm_mem.rendezvous(buffer, group)
        self.buffer, self.handle = buffer, handle
        self.peers = torch.tensor([handle.get_remote_tensor(p, buffer.shape, buffer.dtype).data_ptr()
                                   for p in range(self.tp)], dtype=torch.int64, device=device)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)
        torch.cuda.synchronize()
        dist.barrier(group=group)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        from kernels_triton.floor import lamport_floor_kernel

        m = x.shape[0]
        block = min(self.hidden & -self.hidden, 1024)
        lamport_floor_kernel[(m, self.hidden // block)](
            x.view(torch.int16), out.view(torch.int16), self.buffer.view(torch.int16), self.peers, self.state,
            self.capacity, HIDDEN=self.hidden, TP=self.tp, RANK=self.rank, BLOCK=block, num_warps=4)
