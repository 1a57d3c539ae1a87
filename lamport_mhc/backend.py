"""The interface every kernel backend implements, and the lazy registry of backends.

A backend module (``kernels_triton.backend``, ``kernels_cute.backend``) exposes a class with
- ``name``;
- ``support(spec, device) -> Support``: can it build ``spec`` here; a "no" says why and what to do;
- ``build(spec, workspace, interpret=False) -> Kernels``: compile every kernel the build needs (at
  construction, never during a call or a CUDA-graph capture) over the given workspace;
- ``compile_offline(spec, arch) -> {kernel name: PTX}``: the same kernels, compiled with no GPU.
``Kernels`` launches the four steps of a call (or LL's one-kernel form, or at tp = 1 the local form);
``lamport_mhc.paths.FusedPath`` sequences them.
Backends are imported only when selected, so a missing optional dependency costs nothing until used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .layout import owner_capacity

if TYPE_CHECKING:
    from .call import Call
    from .workspace import Workspace

PROTOCOLS = ("ll", "bt")
# A group of one needs no all-reduce: its one kernel computes the contribution and consumes it in
# place (no publish, no mailbox, no poll).
LOCAL = "local"
TRANSPORTS = ("peer", "multicast")


@dataclass(frozen=True)
class BuildSpec:
    """Everything that fixes the compiled kernels of one rank of one ``AllReduceMHC`` build."""

    hidden: int
    hc: int
    capacity: int
    top_k: int
    tp: int
    rank: int
    quantize: bool = False
    residual_only: bool = False
    bt: bool = False  # BT mailboxes and kernels exist (capacity reaches a BT threshold)
    transport: str = "peer"
    use_pdl: bool = True
    spin_timeout_ns: int = 0  # 0: spin loops wait forever
    # LL calls of at most this many rows run publish and consumer as one kernel (0: never). Each
    # program waits for its twins on the other ranks, so all must be resident: at most the SM count.
    ll_one_kernel_rows: int = 0
    # Calls of at most this many rows spread each token over several programs (the latency forms:
    # Triton's cooperative form, CuTe's cluster form);
    # None: the backend's own bound.
    split_rows: int | None = None
    # Rows of the LL mailbox and of the BT sums (None: capacity): the most rows one call of that
    # protocol takes. A larger call goes through in consecutive parts of at most ``chunk_rows``
    # (``selector.mailbox_rows``).
    ll_rows: int | None = None
    bt_rows: int | None = None

    def rows(self, protocol: str) -> int:
        """Tokens per generation of the protocol's mailbox (LL: per source; BT: of the sums)."""
        rows = self.bt_rows if protocol == "bt" else self.ll_rows
        return self.capacity if rows is None else rows

    @property
    def owner_capacity(self) -> int:
        """Rows of one source in an owner's BT mailbox."""
        return owner_capacity(self.rows("bt"), self.tp)

    def slots(self, protocol: str) -> int:
        """Tokens per [generation][source] of the protocol's contribution mailbox."""
        return self.owner_capacity if protocol == "bt" else self.rows("ll")

    def mailbox_layout(self) -> dict:
        """What fixes the mailboxes and state words: builds alike in it may share a workspace."""
        return dict(hidden=self.hidden, tp=self.tp, bt=self.bt, ll_rows=self.rows("ll"),
                    bt_rows=self.rows("bt") if self.bt else None)

    @property
    def chunk_rows(self) -> int:
        """The most rows one protocol round takes; larger calls go through in parts of this many."""
        return max(self.rows("ll"), self.rows("bt") if self.bt else 0)

    @property
    def protocols(self) -> tuple[str, ...]:
        if self.tp == 1:
            return (LOCAL,)
        return PROTOCOLS if self.bt else PROTOCOLS[:1]

    @property
    def variants(self) -> tuple[str, ...]:
        return ("plain",) + (("quant",) if self.quantize else ()) + (
            ("residual",) if self.residual_only else ())


@dataclass(frozen=True)
class Support:
    """A backend's answer for one build on one device; ``reason`` is actionable when ``ok`` is False."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Support:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


def cuda_device_support(device: torch.device, minimum: tuple[int, int], needs: str, elsewhere: str) -> Support:
    """The checks every GPU backend starts with: a CUDA device, CUDA usable, compute capability at
    least ``minimum`` (``needs`` says for what); ``elsewhere`` says what to do without a device."""
    if device.type != "cuda":
        return Support.no(f"the {elsewhere}")
    if not torch.cuda.is_available():
        return Support.no("CUDA is not available in this process")
    capability = torch.cuda.get_device_capability(device)
    if capability < minimum:
        return Support.no(f"compute capability {capability} is below sm_{minimum[0]}{minimum[1]} ({needs})")
    return Support.yes()


def symmetric_memory_support(spec: BuildSpec, device: torch.device) -> Support:
    """What every GPU backend's workspace needs: torch symmetric memory, and P2P from this GPU to
    every other GPU of the machine (the peer transport stores through their addresses)."""
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as error:
        return Support.no(f"torch symmetric memory is unavailable: {error}")
    for peer in range(torch.cuda.device_count()):
        if peer != device.index and spec.tp > 1 and not torch.cuda.can_device_access_peer(device.index, peer):
            return Support.no(f"GPU {device.index} cannot access GPU {peer} (P2P is required)")
    return Support.yes()


@dataclass
class ConsumerArgs:
    """A validated call's consumer inputs and the outputs it writes (allocated by the caller)."""

    variant: str
    residual: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    pre: torch.Tensor | None
    norm_weight: torch.Tensor | None
    norm_eps: float
    residual_out: torch.Tensor
    layer_input: torch.Tensor | None
    mxfp8_values: torch.Tensor | None
    mxfp8_scales: torch.Tensor | None


class Kernels(Protocol):
    """What a backend launches per call, on the stream of the current device."""

    spec: BuildSpec  # the build as compiled (a backend may lower ``ll_one_kernel_rows`` to what it can hold)

    def publish(self, protocol: str, x: torch.Tensor) -> None: ...

    def finalize_publish(self, protocol: str, gemm2: torch.Tensor, weights: torch.Tensor,
                         indices: torch.Tensor, shared: torch.Tensor) -> None: ...

    def owner_reduce(self, m: int) -> None: ...

    def consume(self, protocol: str, args: ConsumerArgs) -> None: ...

    def publish_and_consume(self, call: Call, phases: str = "both") -> None:
        """An LL call as one kernel (``spec.ll_one_kernel_rows``). ``phases`` "publish" then
        "consume" launch its halves separately, for the simulated group's rank-by-rank order."""
        ...

    def local(self, call: Call) -> None:
        """A call of a group of one (``spec.protocols == ("local",)``) as one kernel: the contribution
        (``x`` or the MoE finalize) is consumed where it is computed."""
        ...


class KernelBackend(Protocol):
    name: str

    def support(self, spec: BuildSpec, device: torch.device) -> Support: ...

    def build(self, spec: BuildSpec, workspace: Workspace, interpret: bool = False) -> Kernels: ...

    def compile_offline(self, spec: BuildSpec, arch: str) -> dict[str, str]:
        """PTX of every kernel of ``spec`` for ``arch`` (e.g. sm_90a), compiled without a GPU."""
        ...


# name -> (module, class); "torch" is the unfused path and needs no kernels.
_REGISTRY = {
    "triton": ("kernels_triton.backend", "TritonBackend"),
    "cute": ("kernels_cute.backend", "CuteBackend"),
}
FUSED_BACKENDS = tuple(_REGISTRY)
ALL_BACKENDS = FUSED_BACKENDS + ("torch",)


def load_backend(name: str) -> KernelBackend | Support:
    """The backend object, or a ``Support.no`` saying why it cannot be imported here."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown fused backend {name!r}; expected one of {FUSED_BACKENDS}")
    module_name, class_name = _REGISTRY[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name.split(".")[0]:
            return Support.no(f"the {name} backend is not part of this installation ({module_name} is missing)")
        return Support.no(f"the {name} backend needs {error.name!r}: pip install 'lamport-mhc[cute]'"
                          if name == "cute" else f"the {name} backend needs {error.name!r}")
    except ImportError as error:
        return Support.no(f"the {name} backend failed to import: {error}")
    return getattr(module, class_name)()
