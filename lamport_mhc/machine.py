"""What this machine offers: GPUs, peer access, the multicast policy and the installed toolchains.

Everything here is a query. :func:`probe` reads device properties through ``torch.cuda`` (which
initializes torch's CUDA runtime state in this process, as any such query does) but allocates
nothing, never rendezvous-es symmetric memory and never creates a multicast object. Optional
packages are looked up through their distribution metadata, without importing them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from dataclasses import dataclass

__all__ = [
    "MULTICAST_ENV",
    "MachineInfo",
    "describe",
    "multicast_allowed",
    "multicast_disabled_by_env",
    "probe",
]

# PyTorch symmetric memory creates no multicast object when this is set; the project follows the
# same switch for its own multicast transport.
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"

# Values that leave the switch off. Anything else counts as "disabled": PyTorch itself honours only
# "1", so reading unknown values as "disabled" errs toward the peer transport, never toward multicast.
_FALSE_VALUES = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True)
class MachineInfo:
    """A snapshot of this machine, as :func:`probe` found it.

    ``gpus``: CUDA device names in index order (empty without CUDA); a tuple, so the cached snapshot
    cannot be changed by a caller. ``capability``: (major, minor) of GPU 0, None without a GPU.
    ``peer_access``: every ordered pair of GPUs can access each other (True for 0 or 1 GPU).
    ``multicast_disabled_by_env``: ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` set to a true value.
    ``symmetric_memory``: ``torch.distributed._symmetric_memory`` is importable.
    ``*_version``: installed distribution versions, None where not installed.
    """

    gpus: tuple[str, ...]
    capability: tuple[int, int] | None
    peer_access: bool
    multicast_disabled_by_env: bool
    symmetric_memory: bool
    triton_version: str | None
    cute_dsl_version: str | None
    flashinfer_version: str | None
    torch_version: str


def multicast_disabled_by_env() -> bool:
    """True when ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` is set to a true value (read now, not cached)."""
    value = os.environ.get(MULTICAST_ENV)
    if value is None:
        return False
    return value.strip().lower() not in _FALSE_VALUES


def multicast_allowed() -> bool:
    """Whether the environment permits the multicast transport (read now, not cached).

    This is the policy half only: multicast is used when this is True *and* the rendezvous handle
    offers a multicast address (``multicast_ptr != 0``).
    """
    return not multicast_disabled_by_env()


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _symmetric_memory_importable() -> bool:
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except Exception:
        return False
    return True


def _cuda_devices() -> tuple[tuple[str, ...], tuple[int, int] | None, bool]:
    import torch

    try:
        if not torch.cuda.is_available():
            return (), None, True
        count = torch.cuda.device_count()
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
        capability = tuple(torch.cuda.get_device_capability(0)) if count else None
        peer = all(
            torch.cuda.can_device_access_peer(i, j)
            for i in range(count)
            for j in range(count)
            if i != j
        )
    except (RuntimeError, AssertionError):
        # A broken driver or an unusable device reads as "no GPU" rather than failing a query.
        return (), None, True
    return names, capability, peer


@functools.lru_cache(maxsize=None)
def probe() -> MachineInfo:
    """Probe this machine once (cached; ``probe.cache_clear()`` forgets the snapshot)."""
    import torch

    gpus, capability, peer_access = _cuda_devices()
    return MachineInfo(
        gpus=gpus,
        capability=capability,
        peer_access=peer_access,
        multicast_disabled_by_env=multicast_disabled_by_env(),
        symmetric_memory=_symmetric_memory_importable(),
        triton_version=_dist_version("triton", "pytorch-triton"),
        cute_dsl_version=_dist_version("nvidia-cutlass-dsl"),
        flashinfer_version=_dist_version("flashinfer-python"),
        torch_version=str(torch.__version__),
    )


# The versions each tier has passed on (README.md's version matrix), by distribution: what ``info``
# calls tested. A local suffix ("+cpu", "+cu130") is not part of the match.
TESTED_VERSIONS: dict[str, dict[str, str]] = {
    "torch": {"2.10.0": "CPU tiers", "2.11.0": "GPU tier", "2.13.0": "CPU tiers", "2.14.1": "CPU tiers"},
    "triton": {"3.6.0": "CPU and GPU tiers", "3.8.0": "CPU tiers"},
    "nvidia-cutlass-dsl": {"4.8.1": "CuTe compile tier and GPU tier", "4.8.0": "CuTe compile tier"},
    "flashinfer-python": {"0.7.2.post1": "CuTe compile tier and GPU tier", "0.7.2": "CuTe compile tier"},
}


def tested(distribution: str, version: str | None) -> str:
    """``version`` of ``distribution`` and whether the project's tiers passed on it."""
    if version is None:
        return "not installed"
    known = TESTED_VERSIONS.get(distribution, {})
    passed = known.get(version.split("+", 1)[0])
    if passed is not None:
        return f"{version} (tested: {passed})"
    return f"{version} (not a tested version; tested: {', '.join(sorted(known))})"


def describe(info: MachineInfo) -> list[str]:
    """Human-readable lines describing ``info`` (what ``python -m lamport_mhc info`` prints)."""
    lines = [f"torch: {tested('torch', info.torch_version)}"]
    if info.gpus:
        for i, name in enumerate(info.gpus):
            lines.append(f"GPU {i}: {name}")
    else:
        lines.append("GPUs: none (CUDA not available)")
    if info.capability is not None:
        major, minor = info.capability
        lines.append(f"compute capability (GPU 0): {major}.{minor} (sm_{major}{minor})")
    if len(info.gpus) < 2:
        lines.append("peer access: not needed (fewer than 2 GPUs)")
    elif info.peer_access:
        lines.append(f"peer access: yes, between all {len(info.gpus)} GPUs")
    else:
        lines.append("peer access: NO between some GPU pairs (the peer transport cannot run)")
    if info.multicast_disabled_by_env:
        lines.append(f"multicast: disabled by {MULTICAST_ENV} (peer transport only)")
    else:
        lines.append("multicast: allowed by the environment (used only where the rendezvous "
                     "handle offers a multicast address)")
    lines.append("symmetric memory: "
                 + ("available" if info.symmetric_memory
                    else "not available (torch.distributed._symmetric_memory not importable)"))
    lines.append(f"triton: {tested('triton', info.triton_version)}")
    lines.append(f"CuTe DSL (nvidia-cutlass-dsl): {tested('nvidia-cutlass-dsl', info.cute_dsl_version)}")
    lines.append(f"flashinfer: {tested('flashinfer-python', info.flashinfer_version)}")
    return lines
