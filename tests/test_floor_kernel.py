"""The benchmark's Lamport all-reduce floor kernel, interpreted for one rank: it returns the input
(-0.0 canonicalized), re-arms its mailbox and advances the generation once per launch."""

import torch

from kernels_triton.floor import lamport_floor_kernel
from kernels_triton.interpret import launch_interpreted
from lamport_mhc import layout


def test_floor_kernel_single_rank():
    capacity, hidden, m = 4, 256, 3
    mailbox = torch.full((layout.GENERATIONS, 1, capacity, hidden), layout.SENTINEL_INT16, dtype=torch.int16)
    peers = torch.tensor([mailbox.data_ptr()], dtype=torch.int64)
    state = torch.zeros(2, dtype=torch.int32)
    for call in range(4):
        x = torch.randn(m, hidden).bfloat16()
        x[0, 0] = -0.0
        out = torch.empty_like(x)
        launch_interpreted(lamport_floor_kernel, (m, 2), x.view(torch.int16), out.view(torch.int16), mailbox,
                           peers, state, capacity, HIDDEN=hidden, TP=1, RANK=0, BLOCK=128, ON_GPU=False)
        expected = x.view(torch.int16).clone()
        expected[0, 0] = 0
        assert torch.equal(out.view(torch.int16), expected)
        assert state.tolist() == [(call + 1) % 3, 0]
        assert (mailbox == layout.SENTINEL_INT16).all()
