"""Lamport mailboxes, generation state and the transport of one rank.

Per protocol: the mailbox this rank reads, the table of every rank's copy of it (peer transport:
one 16-byte store per destination), the multicast address of it (multicast transport; 0 when
unused) and the ``[next, active]`` generation state. ``allocate`` builds them in symmetric memory,
collectively over a process group; ``allocate_host_group`` builds the host twin of a whole TP group
for the simulated group, with the same layouts and tables of host addresses.

The spin-timeout record (``layout.RECORD_WORDS``) lives twice: in the device error buffer, whose
flag the kernels claim with an atomic CAS, and in a host mirror (pinned host memory on GPUs) whose
address the error buffer holds. The host reads only the mirror: no device copy, no synchronization,
so a call may look at it while a CUDA graph is being captured, and it sees what a replayed graph's
kernels recorded.

Layouts (int16 views of bf16 slots, filled with the sentinel):
- LL contributions  ``[3][tp][ll_rows][hidden]``, written by every rank;
- BT contributions  ``[3][tp][ceil(bt_rows / tp)][hidden]``, written by the ranks to the owner;
- BT sums           ``[3][bt_rows][hidden]``, written by the owners; shares BT's generation state.
(``BuildSpec.rows``: the most rows one call of the protocol takes; larger calls go in parts.)
A group of one (the local form) has no mailbox at all: only the state and error words.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field

import torch

from . import layout
from .backend import BuildSpec


@dataclass
class Mailbox:
    local: torch.Tensor           # int16, this rank's copy
    peers: torch.Tensor           # int64 [tp]: address of every rank's copy, on the local device
    multicast: int = 0            # multicast address of the buffer (0: not used)


@dataclass
class Workspace:
    tp: int
    rank: int
    transport: str
    ll: Mailbox | None            # None for a group of one
    ll_state: torch.Tensor        # int32 [3]
    bt: Mailbox | None = None
    bt_sums: Mailbox | None = None
    bt_state: torch.Tensor | None = None
    error: torch.Tensor = None    # int32 [ERROR_WORDS], device: the claimed record + the mirror's address
    error_mirror: torch.Tensor = None  # int32 [RECORD_WORDS], host (pinned on GPUs): what the host reads
    _keepalive: list = field(default_factory=list, repr=False)
    _mirror_words: object = field(default=None, init=False, repr=False)  # numpy view of error_mirror

    def __post_init__(self):
        if self.error_mirror is not None:
            self._mirror_words = self.error_mirror.numpy()  # each index reads the memory anew

    def state(self, protocol: str) -> torch.Tensor:
        return self.bt_state if protocol == "bt" else self.ll_state

    def contributions(self, protocol: str) -> Mailbox:
        """The mailbox the protocol's publishes write."""
        return self.bt if protocol == "bt" else self.ll

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of all mutable state, for checking that a rejected call touched nothing."""
        tensors = {"ll_state": self.ll_state, "error": self.error, "error_mirror": self.error_mirror}
        if self.ll is not None:
            tensors["ll"] = self.ll.local
        if self.bt is not None:
            tensors.update(bt=self.bt.local, bt_sums=self.bt_sums.local, bt_state=self.bt_state)
        return {name: tensor.clone() for name, tensor in tensors.items()}

    def read_error(self) -> tuple[int, int, int] | None:
        """The spin-timeout record (source rank, generation, token) if a kernel gave up waiting, as
        far as the host sees now: a read of the host mirror, never of device memory, so it costs no
        copy and no synchronization and is allowed during CUDA-graph capture. A kernel still
        running may record later; ``torch.cuda.synchronize`` first to cover every launched kernel."""
        words = self._mirror_words
        if not words[0]:
            return None
        # The flag first: the kernel stores it last, after a system-scope fence. A lock's atomic
        # read-modify-write keeps the record's loads after the flag's on weakly ordered hosts (Arm).
        with _HOST_FENCE:
            pass
        return int(words[1]), int(words[2]), int(words[3])


_HOST_FENCE = threading.Lock()


def error_buffers(device) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed error buffer on ``device`` holding the address of a zeroed host mirror, and the
    mirror: pinned on a GPU (the current device), a plain host tensor for the simulated group."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    mirror = torch.zeros(layout.RECORD_WORDS, dtype=torch.int32, pin_memory=on_gpu)
    address = mapped_address(mirror) if on_gpu else mirror.data_ptr()
    words = torch.zeros(layout.ERROR_WORDS, dtype=torch.int32)
    words.view(torch.int64)[layout.ERROR_MIRROR_ADDRESS] = address
    return words.to(device), mirror


# CUDA driver: cuPointerGetAttribute and CU_POINTER_ATTRIBUTE_DEVICE_POINTER.
_DEVICE_POINTER = 3


def mapped_address(host: torch.Tensor) -> int:
    """The address by which kernels reach the pinned host tensor ``host``. Under unified addressing
    it is the host address for ``cudaHostAlloc`` memory (torch's default pinned allocator), but
    not always for registered memory (``pinned_use_cuda_host_register``): the driver says which,
    as Triton's launcher asks it for every pointer argument."""
    import ctypes

    if not host.is_pinned():
        raise ValueError("the spin-timeout mirror must be pinned host memory")
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no Linux driver library by that name: unified addressing's identity
        return host.data_ptr()
    address = ctypes.c_uint64()
    status = driver.cuPointerGetAttribute(ctypes.byref(address), ctypes.c_int(_DEVICE_POINTER),
                                          ctypes.c_uint64(host.data_ptr()))
    if status != 0 or not address.value:
        raise RuntimeError(f"the CUDA driver gave no device mapping of the pinned spin-timeout mirror "
                           f"(cuPointerGetAttribute returned {status})")
    return address.value


def mailbox_shapes(spec: BuildSpec) -> dict[str, tuple[int, ...]]:
    g, tp, h = layout.GENERATIONS, spec.tp, spec.hidden
    if tp == 1:
        return {}
    shapes = {"ll": (g, tp, spec.rows("ll"), h)}
    if spec.bt:
        shapes.update(bt=(g, tp, spec.owner_capacity, h), bt_sums=(g, spec.rows("bt"), h))
    return shapes


def mailbox_bytes(spec: BuildSpec) -> int:
    """Bytes of one rank's mailboxes (bf16 slots) for a build."""
    return sum(2 * math.prod(shape) for shape in mailbox_shapes(spec).values())


def _sentinel_filled(shape, device) -> torch.Tensor:
    return torch.full(shape, layout.SENTINEL_INT16, dtype=torch.int16, device=device)


def allocate_host_group(specs: list[BuildSpec], device="cpu") -> list[Workspace]:
    """Host mailboxes of a simulated TP group: rank r's tables hold the host addresses of every
    rank's buffers, exactly as a device table holds peer addresses. With a CUDA ``device``, the
    same group in that one GPU's memory (for tests of what one rank does when its peers do not)."""
    device = torch.device(device)
    buffers = [{name: _sentinel_filled(shape, device) for name, shape in mailbox_shapes(s).items()}
               for s in specs]

    def mailbox(name: str, rank: int) -> Mailbox:
        table = torch.tensor([b[name].data_ptr() for b in buffers], dtype=torch.int64, device=device)
        return Mailbox(local=buffers[rank][name], peers=table)

    workspaces = []
    for rank, spec in enumerate(specs):
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            error, mirror = error_buffers(device)
        ws = Workspace(tp=spec.tp, rank=rank, transport="peer", ll=mailbox("ll", rank) if spec.tp > 1 else None,
                       ll_state=torch.zeros(layout.STATE_WORDS, dtype=torch.int32, device=device),
                       error=error, error_mirror=mirror)
        if spec.bt:
            ws.bt, ws.bt_sums = mailbox("bt", rank), mailbox("bt_sums", rank)
            ws.bt_state = torch.zeros(layout.STATE_WORDS, dtype=torch.int32, device=device)
        ws._keepalive.append(buffers)  # every rank's tables point into every rank's buffers
        workspaces.append(ws)
    return workspaces


def resolve_transport(requested: str, multicast_addresses: list[int], environment_allows: bool) -> str:
    """"peer" or "multicast" for a build: multicast only where every buffer it would write has a
    16-byte aligned multicast address and the environment does not disable it."""
    available = environment_allows and all(a and a % 16 == 0 for a in multicast_addresses)
    if requested == "auto":
        return "multicast" if available else "peer"
    if requested == "multicast" and not available:
        raise RuntimeError("transport='multicast' but the symmetric-memory handles have no usable multicast "
                           "address here (or TORCH_SYMM_MEM_DISABLE_MULTICAST is set); use 'peer' or 'auto'")
    return requested


def allocate(spec: BuildSpec, group, device: torch.device, transport: str) -> Workspace:
    """Symmetric-memory workspace of this rank (collective over ``group``; ends in a barrier).

    ``transport``: "peer", "multicast" or "auto" (multicast when the rendezvous handle has a
    multicast address and the environment allows it, else peer). The resolved transport is
    recorded in the workspace; the caller compiles its kernels for it.
    """
    import torch.distributed as dist

    if spec.tp == 1:  # the local form: nothing to share
        with torch.cuda.device(device):
            error, mirror = error_buffers(device)
        return Workspace(tp=1, rank=0, transport="peer", ll=None,
                         ll_state=torch.zeros(layout.STATE_WORDS, dtype=torch.int32, device=device),
                         error=error, error_mirror=mirror)

    import torch.distributed._symmetric_memory as symm_mem

    from .machine import multicast_allowed

    mailboxes: dict[str, Mailbox] = {}
    handles = []
    for name, shape in mailbox_shapes(spec).items():
        buffer = symm_mem.empty(shape, dtype=torch.bfloat16, device=device)
        buffer.view(torch.int16).fill_(layout.SENTINEL_INT16)
        handle = symm_mem.rendezvous(buffer, group)
        handles.append((buffer, handle))
        peers = [handle.get_remote_tensor(peer, shape, torch.bfloat16).data_ptr() for peer in range(spec.tp)]
        if not all(peers) or any(address % 16 for address in peers):
            raise RuntimeError(f"symmetric memory gave no 16-byte aligned peer mapping for the {name} mailbox")
        multicast = int(getattr(handle, "multicast_ptr", 0) or 0)
        mailboxes[name] = Mailbox(local=buffer.view(torch.int16),
                                  peers=torch.tensor(peers, dtype=torch.int64, device=device),
                                  multicast=multicast)

    # LL publishes and BT owners broadcast by multicast; BT publishes are always unicast to owners.
    addresses = [mailboxes[name].multicast for name in ("ll", "bt_sums") if name in mailboxes]
    transport = resolve_transport(transport, addresses, multicast_allowed())
    if transport == "peer":
        for m in mailboxes.values():
            m.multicast = 0

    with torch.cuda.device(device):  # the driver maps the mirror in this device's context
        error, mirror = error_buffers(device)
    ws = Workspace(tp=spec.tp, rank=spec.rank, transport=transport, ll=mailboxes["ll"],
                   ll_state=torch.zeros(layout.STATE_WORDS, dtype=torch.int32, device=device),
                   error=error, error_mirror=mirror)
    if spec.bt:
        ws.bt, ws.bt_sums = mailboxes["bt"], mailboxes["bt_sums"]
        ws.bt_state = torch.zeros(layout.STATE_WORDS, dtype=torch.int32, device=device)
    ws._keepalive.extend(handles)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return ws
