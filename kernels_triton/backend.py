"""The Triton backend: builds the kernel plan of a spec over a workspace and launches it.

On a GPU the kernels are compiled at construction (``warmup``) with fp fusion off, PDL on sm_90+.
With ``interpret=True`` the same kernel bodies run under the Triton interpreter on host buffers
(``ON_GPU=False`` selects the interpreter twins of the PTX helpers): the simulated TP group.
"""

from __future__ import annotations

import torch

from lamport_mhc.backend import BuildSpec, ConsumerArgs, Support, cuda_device_support, symmetric_memory_support
from lamport_mhc.call import Call
from lamport_mhc.workspace import Workspace

from .interpret import launch_interpreted
from .consumer import CONSUME_ONLY, PUBLISH_ONLY
from .plan import chunk_width, kernel_plan

PHASE_CODES = {"publish": PUBLISH_ONLY.value, "consume": CONSUME_ONLY.value}

MIN_CAPABILITY = (9, 0)  # griddepcontrol (PDL) and multimem.st


class TritonBackend:
    name = "triton"

    def support(self, spec: BuildSpec, device: torch.device) -> Support:
        answer = cuda_device_support(device, MIN_CAPABILITY, "PDL, multimem", "Triton kernels need a CUDA device "
                                     "(on CPU use lamport_mhc.SimulatedGroup, which interprets them)")
        return answer if not answer.ok else symmetric_memory_support(spec, device)

    def build(self, spec: BuildSpec, workspace: Workspace, interpret: bool = False) -> TritonKernels:
        return TritonKernels(spec, workspace, interpret)

    def compile_offline(self, spec: BuildSpec, arch: str) -> dict[str, str]:
        from .offline import compile_ptx
        return compile_ptx(spec, arch)


class TritonKernels:
    def __init__(self, spec: BuildSpec, workspace: Workspace, interpret: bool):
        self.spec = spec
        self.workspace = workspace
        self.interpret = interpret
        self.plan = kernel_plan(spec, on_gpu=not interpret)
        device = workspace.ll.local.device
        # Stand-ins for pointer arguments a specialization never dereferences.
        self._unused = {dtype: torch.zeros(16, dtype=dtype, device=device)
                        for dtype in (torch.int16, torch.float32, torch.int32, torch.uint8)}
        if not interpret:
            self._compile_all()

    # -- launching -------------------------------------------------------------------------------
    def _launch(self, name: str, grid, *args, **overrides):
        """``overrides`` replace constexprs; only the interpreter takes them (compiled kernels are fixed)."""
        instance = self.plan[name]
        if self.interpret:
            launch_interpreted(instance.fn, grid, *args, **{**instance.constexprs, **overrides})
        else:
            if overrides:
                raise ValueError(f"{name}: constexpr overrides {sorted(overrides)} are for the interpreter only")
            instance.fn[grid](*args, **instance.constexprs, num_warps=instance.num_warps,
                              enable_fp_fusion=False, launch_pdl=self.spec.use_pdl)

    def _compile_all(self) -> None:
        """Compile every kernel now, so no call (and no CUDA-graph capture) compiles."""
        for instance in self.plan.values():
            args = [self._placeholder(arg, kind) for arg, kind in instance.signature.items()]
            instance.fn.warmup(*args, grid=(1,), **instance.constexprs, num_warps=instance.num_warps,
                               enable_fp_fusion=False, launch_pdl=self.spec.use_pdl)

    def _placeholder(self, arg: str, kind: str):
        """An argument of the kind a real launch passes (scalars typed as at run time)."""
        pointers = {"*i16": torch.int16, "*fp32": torch.float32, "*i32": torch.int32, "*u8": torch.uint8}
        if kind in pointers:
            return self._unused[pointers[kind]]
        if kind == "*i64":
            return self.workspace.ll.peers
        if arg == "multicast_address":
            return self.workspace.ll.multicast
        if arg == "sums_multicast_address":
            return self.workspace.bt_sums.multicast
        if arg == "timeout_ns":
            return self.spec.spin_timeout_ns
        if arg in ("slots", "capacity"):
            return self.spec.capacity
        return {"i32": 2, "fp32": 1e-6}[kind]

    # -- the Kernels interface ---------------------------------------------------------------------
    def publish(self, protocol: str, x: torch.Tensor) -> None:
        mailbox = self.workspace.contributions(protocol)
        grid = (x.shape[0], self.spec.hidden // chunk_width(self.spec.hidden))
        self._launch(f"publish_{protocol}", grid, x.view(torch.int16), self._unused[torch.int16],
                     self._unused[torch.float32], self._unused[torch.int32], self.workspace.state(protocol),
                     mailbox.peers, mailbox.multicast, self.spec.slots(protocol))

    def finalize_publish(self, protocol: str, gemm2, weights, indices, shared) -> None:
        mailbox = self.workspace.contributions(protocol)
        grid = (shared.shape[0], self.spec.hidden // chunk_width(self.spec.hidden))
        self._launch(f"finalize_publish_{protocol}", grid, shared.view(torch.int16), gemm2.view(torch.int16),
                     weights, indices, self.workspace.state(protocol), mailbox.peers, mailbox.multicast,
                     self.spec.slots(protocol))

    def owner_reduce(self, m: int) -> None:
        ws, spec = self.workspace, self.spec
        grid = (max(1, -(-m // spec.tp)), spec.hidden // chunk_width(spec.hidden))
        self._launch("owner_reduce_bt", grid, ws.bt.local, ws.bt_sums.peers, ws.bt_sums.multicast,
                     ws.bt_state, ws.error, m, self.spec.spin_timeout_ns, spec.owner_capacity, spec.capacity)

    def consume(self, protocol: str, args: ConsumerArgs) -> None:
        i16, f32, i32 = self._unused[torch.int16], self._unused[torch.float32], self._unused[torch.int32]
        self._launch(f"consumer_{protocol}_{args.variant}", (args.residual.shape[0],),
                     *self._consumer_args(protocol, args), i16, i16, f32, i32, self.workspace.ll.peers,
                     self.workspace.ll.multicast)

    def publish_and_consume(self, call: Call, phases: str = "both") -> None:
        args, ws = call.consumer, self.workspace
        if call.kind == "finalize":
            name, publish = f"one_kernel_finalize_ll_{args.variant}", (
                call.shared.view(torch.int16), call.gemm2.view(torch.int16), call.weights, call.indices)
        else:
            name, publish = f"one_kernel_ll_{args.variant}", (
                call.x.view(torch.int16), self._unused[torch.int16], self._unused[torch.float32],
                self._unused[torch.int32])
        phase_overrides = {} if phases == "both" else {"PHASES": PHASE_CODES[phases]}
        self._launch(name, (call.m,), *self._consumer_args("ll", args), *publish, ws.ll.peers, ws.ll.multicast,
                     **phase_overrides)

    def _consumer_args(self, protocol: str, args: ConsumerArgs) -> list:
        """The consumer's arguments up to ``capacity`` (the publish arguments follow)."""
        ws = self.workspace
        source = ws.bt_sums.local if protocol == "bt" else ws.ll.local
        residual_only = args.variant == "residual"
        i16, f32, u8 = self._unused[torch.int16], self._unused[torch.float32], self._unused[torch.uint8]
        return [source, args.residual.view(torch.int16), args.post, args.comb, f32 if residual_only else args.pre,
                i16 if residual_only else args.norm_weight.view(torch.int16), args.residual_out.view(torch.int16),
                i16 if residual_only else args.layer_input.view(torch.int16),
                u8 if args.mxfp8_values is None else args.mxfp8_values.view(torch.uint8),
                u8 if args.mxfp8_scales is None else args.mxfp8_scales, ws.state(protocol), ws.error,
                float(args.norm_eps), args.residual.shape[0], self.spec.spin_timeout_ns, self.spec.capacity]
