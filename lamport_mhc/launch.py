"""Where a torchrun rank runs: its device and its host process group, for the commands.

One process per GPU is the production layout: each rank takes GPU ``LOCAL_RANK`` and the group
runs on NCCL. A node with fewer GPUs than ranks (``torchrun --nproc-per-node 4`` on one GPU) is a
way to run the production path (symmetric-memory rendezvous, peer tables, one host per rank) on a
small machine: the ranks share the GPUs round-robin, PyTorch's symmetric memory is told to admit
ranks on one device (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES``), and the host-side collectives
run on gloo, since NCCL refuses two ranks on one GPU. Kernels of different processes take turns on
a GPU in time slices: such a group checks construction, IPC, tables and the call path, not speed
and not kernels running at once (the one-GPU group of ``lamport_mhc.concurrent`` shows that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# PyTorch's symmetric memory refuses a rendezvous of ranks on one device unless this is set.
OVERLAPPING_DEVICES_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


@dataclass(frozen=True)
class RankPlace:
    """This rank of a torchrun group: ``device`` (cuda:i, or cpu without GPUs) and ``shared_gpu``,
    whether the node runs more ranks than it has GPUs (ranks then share them, on gloo)."""

    rank: int
    world_size: int
    device: torch.device
    shared_gpu: bool

    @property
    def where(self) -> str:
        """The soak's name for this layout: 'gpus', 'processes-one-gpu' or 'processes' (CPUs)."""
        if self.device.type != "cuda":
            return "processes"
        return "processes-one-gpu" if self.shared_gpu else "gpus"

    def describe(self) -> str:
        if not self.shared_gpu:
            return f"{self.world_size} ranks on {self.device.type}"
        gpus = torch.cuda.device_count()
        return (f"{self.world_size} ranks on {gpus} GPU{'s' if gpus > 1 else ''} (processes sharing a GPU take "
                f"turns in time slices: the production path, not its speed)")


def placement(local_rank: int, local_world_size: int, gpus: int) -> tuple[int | None, bool]:
    """(GPU index or None for CPU ranks, whether ranks share GPUs) of a rank on a node."""
    if gpus == 0:
        return None, False
    return local_rank % gpus, local_world_size > gpus


def joined_place() -> RankPlace:
    """Where this rank of the initialized default group runs: the current CUDA device (cpu without
    GPUs); ranks share GPUs where the node's ranks (LOCAL_WORLD_SIZE, else the group) outnumber them."""
    import torch.distributed as dist

    world = dist.get_world_size()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", torch.cuda.current_device()) if gpus else torch.device("cpu")
    _, shared = placement(0, local_world, gpus)  # whether ranks share GPUs does not depend on the rank
    return RankPlace(dist.get_rank(), world, device, shared)


def join_torchrun_group(*, allow_shared_gpu: bool = True) -> RankPlace:
    """Join the group torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), set this
    rank's device and return where it runs. ``allow_shared_gpu=False`` refuses ranks that would share
    a GPU (what a timing run must do) with a message that says so, before joining anything."""
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not started by torchrun: run torchrun --nproc-per-node N -m lamport_mhc ...")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index, shared = placement(local_rank, local_world, gpus)
    if shared and not allow_shared_gpu:
        raise SystemExit(f"{local_world} ranks on {gpus} GPU(s): ranks that share a GPU take turns in time slices, "
                         f"so their timings mean nothing; run at most {gpus} ranks per node")
    if index is None:
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(index)
        if shared:
            os.environ.setdefault(OVERLAPPING_DEVICES_ENV, "1")
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("nccl", device_id=torch.device("cuda", index))
    return joined_place()
