"""What one rank's build costs on this machine: the time to compile and load its kernels, and the host
and GPU memory the build takes beside its mailboxes (``python -m lamport_mhc info``).

It builds rank 0 of the group for real, on this GPU, over host-group mailboxes (every rank's in this
GPU's memory: ``workspace.allocate_host_group``), so no process group is needed; the mailboxes are
counted at one rank's size, as a GPU of a real group holds them. The time includes compiling or
loading every kernel from the backend's cache (Triton's, or CuTe's in-process one), as a model's
first build in a new process does.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, replace

import torch

from .backend import BuildSpec, Support, load_backend
from .workspace import allocate_host_group, mailbox_bytes


@dataclass(frozen=True)
class BuildCost:
    backend: str
    seconds: float
    host_held_bytes: int     # resident memory the build still holds once done
    host_peak_bytes: int     # how far the process's peak resident memory rose during the build
    gpu_bytes: int           # device memory the build took (kernels, state words, its allocations)
    mailbox_bytes: int       # one rank's mailboxes

    def line(self) -> str:
        mib = 2 ** 20
        return (f"  {self.backend:7s} build {self.seconds:.1f} s; host +{self.host_held_bytes / mib:.0f} MiB held "
                f"(peak +{self.host_peak_bytes / mib:.0f} MiB); GPU +{self.gpu_bytes / mib:.0f} MiB beside "
                f"{self.mailbox_bytes / mib:.1f} MiB of mailboxes")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(spec: BuildSpec, backend: str, device: torch.device) -> BuildCost:
    """Build rank 0 of ``spec`` with ``backend`` on ``device`` (a GPU) and return what it took."""
    kernels_of = load_backend(backend)
    if isinstance(kernels_of, Support):
        raise RuntimeError(f"backend {backend!r} cannot run here: {kernels_of.reason}")
    with torch.cuda.device(device):
        workspaces = allocate_host_group([replace(spec, rank=r) for r in range(spec.tp)], device)
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info(device)
        resident, peak = _resident(), _peak()
        started = time.perf_counter()
        kernels = kernels_of.build(replace(spec, rank=0, transport=workspaces[0].transport), workspaces[0])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        free_after, _ = torch.cuda.mem_get_info(device)
        cost = BuildCost(backend, seconds, max(_resident() - resident, 0), max(_peak() - peak, 0),
                         max(free_before - free_after, 0), mailbox_bytes(spec))
    del kernels, workspaces
    return cost
