"""Paths that execute a validated call: the fused Lamport path over a kernel backend, and the
unfused torch path (gather + the reference contract) that runs on any process group."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import reference
from .backend import LOCAL, BuildSpec, Kernels
from .call import Call
from .selector import Thresholds, choose_protocol
from .workspace import Workspace


class FusedPath:
    """publish -> (BT: owner reduce) -> consumer, over one rank's workspace, or one kernel for LL calls
    of at most ``spec.ll_one_kernel_rows`` rows, or one kernel for every call of a group of one (the
    local form). The steps are separate so that the simulated group can launch them across ranks in
    protocol order.

    ``kernels`` maps backend names to their kernels, all built over ``workspace``; ``route(call)``
    names the backend of each call (default: the only one). Every backend writes the same mailboxes
    and state words, so consecutive calls, and the ranks of one call, may run different backends.
    """

    def __init__(self, name: str, kernels: dict[str, Kernels], workspace: Workspace, thresholds: Thresholds,
                 route: Callable[[Call], str] | None = None):
        if not kernels:
            raise ValueError("a fused path needs the kernels of at least one backend")
        self.name = name
        self.kernels = kernels
        self.spec = next(iter(kernels.values())).spec  # the workspace's build: BT state, transport
        self.workspace = workspace
        self.thresholds = thresholds
        self.route = route

    def backend(self, call: Call) -> str:
        return self.route(call) if self.route is not None else next(iter(self.kernels))

    def protocol(self, call: Call) -> str:
        return choose_protocol(call.kind, call.m, self.thresholds, self.spec.protocols)

    def parts(self, call: Call) -> list[Call]:
        """The protocol rounds of a call: consecutive row ranges of at most the mailboxes' rows, each
        with the protocol of its own size (every rank splits a call alike)."""
        return list(call.parts(self.spec.chunk_rows))

    def run(self, call: Call) -> None:
        for part in call.parts(self.spec.chunk_rows):
            self._run_part(part)

    def _run_part(self, call: Call) -> None:
        protocol, kernels = self.protocol(call), self.kernels[self.backend(call)]
        if protocol == LOCAL:
            kernels.local(call)
            return
        if self._one_kernel(kernels, call, protocol):
            kernels.publish_and_consume(call)
            return
        self._publish(kernels, call, protocol)
        if protocol == "bt":
            kernels.owner_reduce(call.m)
        self._consume(kernels, call, protocol)

    # The steps of one part (``parts``) at a time, for the simulated group, which launches each
    # across all ranks in turn.
    def publish(self, call: Call, protocol: str) -> None:
        if protocol != LOCAL:
            self._publish(self.kernels[self.backend(call)], call, protocol)

    def reduce(self, call: Call, protocol: str) -> None:
        if protocol == "bt":
            self.kernels[self.backend(call)].owner_reduce(call.m)

    def consume(self, call: Call, protocol: str) -> None:
        if protocol == LOCAL:
            self.kernels[self.backend(call)].local(call)
        else:
            self._consume(self.kernels[self.backend(call)], call, protocol)

    @staticmethod
    def _one_kernel(kernels: Kernels, call: Call, protocol: str) -> bool:
        # A backend may hold fewer rows in one kernel than the build asked for (its own residency bound).
        return protocol == "ll" and call.m <= kernels.spec.ll_one_kernel_rows

    def _publish(self, kernels: Kernels, call: Call, protocol: str) -> None:
        if self._one_kernel(kernels, call, protocol):
            kernels.publish_and_consume(call, "publish")
        elif call.kind == "finalize":
            kernels.finalize_publish(protocol, call.gemm2, call.weights, call.indices, call.shared)
        else:
            kernels.publish(protocol, call.x)

    def _consume(self, kernels: Kernels, call: Call, protocol: str) -> None:
        if self._one_kernel(kernels, call, protocol):
            kernels.publish_and_consume(call, "consume")
        else:
            kernels.consume(protocol, call.consumer)

    def raise_on_timeout(self) -> None:
        """Raise if a spin loop gave up (spin_timeout_ms), as far as the host sees now: reads the
        workspace's host mirror of the record, with no device copy and no synchronization."""
        record = self.workspace.read_error()
        if record is not None:
            source, generation, token = record
            awaited = "the owners' reduced sum" if source == -1 else f"rank {source}'s contribution"
            raise RuntimeError(
                f"{self.name} rank {self.workspace.rank}: spin timeout waiting for {awaited} to token {token} "
                f"of generation {generation}; a peer did not publish (hung, crashed, or issued a different "
                "sequence of calls). This instance is unusable; rebuild it on every rank.")


class TorchPath:
    """The unfused path: gather every rank's contribution, then apply the contract (an all-reduce
    would sum in an unspecified order and precision, so the contributions are gathered)."""

    name = "torch"

    def __init__(self, spec: BuildSpec, group):
        self.spec = spec
        self.group = group

    def contribution(self, call: Call) -> torch.Tensor:
        if call.kind == "finalize":
            return reference.finalize_contribution(call.gemm2, call.weights, call.indices, call.shared)
        return call.x

    def run(self, call: Call) -> None:
        import torch.distributed as dist

        local = self.contribution(call).contiguous()
        # bf16 travels as int32 pairs: every backend (gloo included) moves int32 bit for bit.
        words = local.view(torch.int32)
        gathered = [torch.empty_like(words) for _ in range(self.spec.tp)]
        dist.all_gather(gathered, words, group=self.group)
        self.apply([g.view(torch.bfloat16) for g in gathered], call)

    @staticmethod
    def apply(contributions: list[torch.Tensor], call: Call) -> None:
        c = call.consumer
        residual_out, layer_input, mxfp8 = reference.all_reduce_mhc(
            contributions, c.residual, c.post, c.comb, c.pre, c.norm_weight, c.norm_eps,
            quantize=c.mxfp8_values is not None)
        c.residual_out.copy_(residual_out)
        if c.layer_input is not None:
            c.layer_input.copy_(layer_input)
        if mxfp8 is not None:
            c.mxfp8_values.view(torch.uint8).copy_(mxfp8[0].view(torch.uint8))
            c.mxfp8_scales.copy_(mxfp8[1])
