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


def test_the_error_buffer_holds_the_address_of_its_host_mirror():
    specs = [BuildSpec(hidden=64, hc=4, capacity=4, top_k=2, tp=2, rank=r) for r in range(2)]
    for ws in allocate_host_group(specs):
        assert ws.error.shape == (layout.ERROR_WORDS,) and ws.error_mirror.shape == (layout.RECORD_WORDS,)
        assert ws.error.view(torch.int64)[layout.ERROR_MIRROR_ADDRESS] == ws.error_mirror.data_ptr()
        assert ws.error[:layout.RECORD_WORDS].tolist() == [0] * 4 and ws.error_mirror.tolist() == [0] * 4


def test_the_host_reads_the_mirror_flag_first_and_never_the_device_buffer():
    """What a kernel leaves in the mirror is what the host reports; a record whose flag is not
    (yet) stored is not reported, whatever the other words hold (the kernel stores the flag last)."""
    spec = BuildSpec(hidden=64, hc=4, capacity=4, top_k=2, tp=1, rank=0)
    ws = allocate_host_group([spec])[0]
    ws.error = torch.empty(layout.ERROR_WORDS, dtype=torch.int32, device="meta")  # any read of it fails
    ws.error_mirror[1:].copy_(torch.tensor([1, 2, 5], dtype=torch.int32))
    assert ws.read_error() is None   # record written, flag not yet
    ws.error_mirror[0] = 1
    assert ws.read_error() == (1, 2, 5)
    ws.error_mirror.copy_(torch.tensor([1, -1, 0, 7], dtype=torch.int32))
    assert ws.read_error() == (-1, 0, 7)
