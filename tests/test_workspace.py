"""Workspace layouts and the transport decision (the symmetric-memory allocation itself runs on GPUs)."""

import pytest
import torch

from lamport_mhc import layout
from lamport_mhc.backend import BuildSpec
from lamport_mhc.workspace import allocate_host_group, mailbox_shapes, resolve_transport


def test_multicast_only_where_addresses_exist_and_the_environment_allows():
    assert resolve_transport("auto", [1 << 40, 2 << 40], True) == "multicast"
    assert resolve_transport("auto", [1 << 40, 2 << 40], False) == "peer"   # TORCH_SYMM_MEM_DISABLE_MULTICAST
    assert resolve_transport("auto", [1 << 40, 0], True) == "peer"          # a handle without multicast
    assert resolve_transport("auto", [(1 << 40) + 8], True) == "peer"       # misaligned
    assert resolve_transport("peer", [1 << 40], True) == "peer"
    with pytest.raises(RuntimeError, match="no usable multicast"):
        resolve_transport("multicast", [1 << 40], False)
    with pytest.raises(RuntimeError, match="no usable multicast"):
        resolve_transport("multicast", [0], True)


def test_bt_state_only_when_the_build_reaches_bt():
    spec = BuildSpec(hidden=64, hc=4, capacity=10, top_k=2, tp=3, rank=0)
    assert mailbox_shapes(spec) == {"ll": (3, 3, 10, 64)}
    bt = BuildSpec(hidden=64, hc=4, capacity=10, top_k=2, tp=3, rank=0, bt=True)
    assert mailbox_shapes(bt) == {"ll": (3, 3, 10, 64), "bt": (3, 3, 4, 64), "bt_sums": (3, 10, 64)}


def test_host_group_tables_point_at_every_rank():
    specs = [BuildSpec(hidden=64, hc=4, capacity=4, top_k=2, tp=2, rank=r, bt=True) for r in range(2)]
    workspaces = allocate_host_group(specs)
    for ws in workspaces:
        assert ws.transport == "peer" and ws.bt_state.tolist() == [0, 0, 0] and ws.ll_state.tolist() == [0, 0, 0]
        for name in ("ll", "bt", "bt_sums"):
            table = getattr(ws, name).peers.tolist()
            assert table == [getattr(w, name).local.data_ptr() for w in workspaces]
            assert (getattr(ws, name).local == layout.SENTINEL_INT16).all()
    assert workspaces[0].read_error() is None
    workspaces[1].error.copy_(torch.tensor([1, 0, 2, 5], dtype=torch.int32))
    assert workspaces[1].read_error() == (0, 2, 5)
