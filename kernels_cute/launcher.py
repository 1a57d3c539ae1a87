"""Host side of the CuTe DSL backend: compiles a build's kernels once, at construction, and launches
them per call on the current stream (graph-safe: no allocation, no synchronization, no compile).

Arguments follow each kernel's signature in ``plan``. Buffers travel as 1-D CuTe tensors made from
DLPack views; the workspace's (mailboxes, state, error word, address tables) and the stand-ins for
arguments a kernel never dereferences are converted once and reused on every call.

Each consumer launch picks its form from the call's rows: the cluster form (a token over several
CTAs) up to ``split_rows`` rows, where latency matters, the streaming form (a CTA per token) above.
"""

from __future__ import annotations

from dataclasses import replace

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import from_dlpack

from lamport_mhc.backend import BuildSpec, ConsumerArgs
from lamport_mhc.call import Call
from lamport_mhc.carveout import pin_build
from lamport_mhc.traffic import STREAMED_ROWS, streams_past_l2
from lamport_mhc.workspace import Workspace

from .offline import BUFFER_KINDS, fake_argument, parse_arch
from .plan import STREAMING, kernel_plan
from .publish import launch_shape

# kind -> torch dtype of the buffers a signature names (bf16 data travels as int16 bits)
BUFFER_DTYPES = {"*i16": torch.int16, "*fp32": torch.float32, "*i32": torch.int32, "*u8": torch.uint8,
                 "state": torch.int32, "error": torch.int32, "table": torch.int64}
# Every CTA of a one-kernel call waits for its twins on the other ranks, so all must be resident at
# once. One CTA has 128 threads, so two always fit on an SM whatever its register count (2 x 128 x 255
# < 65,536 registers): a bound of one CTA per SM leaves room for the clusters' placement constraints.
CTAS_PER_SM_BOUND = 1
# Calls of at most this many rows take the cluster form of the consumer, larger ones the streaming
# form (``BuildSpec.split_rows`` overrides it). The cluster form spreads a token over H / 1024 CTAs,
# so few rows still fill the GPU; the streaming form moves more bytes per SM once a call has at least
# about two CTAs per SM (2 x 132 on an H200). To be measured on the target machine.
SPLIT_ROWS = 256


def one_kernel_rows(spec: BuildSpec, device: torch.device) -> int:
    """LL's one-kernel row bound for CuTe: a token spans several CTAs, so the SM count bounds CTAs,
    not rows (H = 5120 on 132 SMs: 26 rows)."""
    ctas_per_token = launch_shape(spec.hidden)[1]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(spec.ll_one_kernel_rows, sms * CTAS_PER_SM_BOUND // ctas_per_token)


# Compiled kernels by what fixes their code: ranks of one process (the concurrent one-GPU group)
# share every kernel but their publishes.
_COMPILED: dict[tuple, object] = {}


def compile_once(instance, spec: BuildSpec, options: str):
    """``cute.compile`` of a plan's kernel, once per process for kernels that compile alike."""
    kernel = instance.kernel
    key = (type(kernel).__name__, repr(sorted(vars(kernel).items())), instance.signature, spec.tp, options)
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(kernel, *[fake_argument(kind, spec)
                                      for _, kind in instance.signature], options=options)
    return _COMPILED[key]


def loaded_function(compiled) -> cuda.CUfunction:
    """The CUfunction of a compiled kernel in the current context: its library loaded (``library``
    loads it) and the kernel loaded into the context (``cuKernelGetFunction``)."""
    from cuda.bindings import runtime

    library = compiled.library
    error, count = runtime.cudaLibraryGetKernelCount(library)
    if error == runtime.cudaError_t.cudaSuccess:
        error, kernels = runtime.cudaLibraryEnumerateKernels(count, library)
    if error != runtime.cudaError_t.cudaSuccess or count != 1:
        raise RuntimeError(f"the compiled CuTe DSL library holds {count} kernels ({error}), expected one")
    error, function = cuda.cuKernelGetFunction(cuda.CUkernel(int(kernels[0])))
    if error != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelGetFunction: {error}")
    return function


def current_stream() -> cuda.CUstream:
    """The current torch stream, which the kernels launch on (the captured one inside a CUDA graph)."""
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def to_cute(tensor: torch.Tensor, kind: str) -> cute.Tensor:
    """A contiguous tensor as the 1-D CuTe tensor its signature kind declares (see ``offline``)."""
    flat = tensor.detach().view(-1).view(BUFFER_DTYPES[kind])
    if kind in BUFFER_KINDS:
        _, align, divisibility = BUFFER_KINDS[kind]
        return from_dlpack(flat, assumed_align=align).mark_compact_shape_dynamic(mode=0, divisibility=divisibility)
    return from_dlpack(flat, assumed_align=flat.element_size())


class CuteKernels:
    """The ``Kernels`` of one CuTe DSL build over a workspace (see ``lamport_mhc.backend``)."""

    def __init__(self, spec: BuildSpec, workspace: Workspace, arch: str | None = None):
        """Compiles every kernel of ``spec`` for ``arch`` (default: the workspace's device)."""
        device = workspace.error.device
        self.spec = replace(spec, ll_one_kernel_rows=one_kernel_rows(spec, device))
        self.workspace = workspace
        self.split_rows = SPLIT_ROWS if spec.split_rows is None else spec.split_rows
        # Local calls in STREAMED_ROWS that move (most of) the L2 take the streaming form's cache
        # hints (``traffic.streams_past_l2``; a runtime argument: one kernel serves both).
        self.streamed_rows = STREAMED_ROWS
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else None
        self.plan = kernel_plan(self.spec)
        # Stand-ins for buffers a specialization never dereferences (divisible as each kind declares).
        self._unused = {kind: torch.zeros(16, dtype=BUFFER_DTYPES[kind], device=device) for kind in BUFFER_KINDS}
        self._unused["table"] = torch.zeros(spec.tp, dtype=torch.int64, device=device)
        self._converted: dict[tuple, cute.Tensor] = {}
        fixed = [(tensor, kind) for kind, tensor in self._unused.items()]
        for mailbox in (workspace.ll, workspace.bt, workspace.bt_sums):
            if mailbox is not None:
                fixed += [(mailbox.local, "*i16"), (mailbox.peers, "table")]
        fixed += [(workspace.ll_state, "state"), (workspace.error, "error")]
        if workspace.bt_state is not None:
            fixed.append((workspace.bt_state, "state"))
        for tensor, kind in fixed:
            self._converted[self._key(tensor, kind)] = to_cute(tensor, kind)

        if arch is None:
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"sm_{major}{minor}"
        options = f"--gpu-arch {parse_arch(arch)}"
        self.compiled = {name: compile_once(instance, self.spec, options) for name, instance in self.plan.items()}
        # Called with (kernel name, CTAs) at every launch (the concurrent one-GPU group's residency check).
        self.on_launch = None
        self._functions: dict[str, cuda.CUfunction] = {}  # load_modules
        if device.type == "cuda" and spec.tp > 1:
            pin_build(self)  # lamport_mhc.carveout: waiting kernels must not starve a peer's

    # -- launching -------------------------------------------------------------------------------
    @staticmethod
    def _key(tensor: torch.Tensor, kind: str) -> tuple:
        return tensor.data_ptr(), tensor.numel(), kind

    def _argument(self, kind: str, value):
        if kind == "stream":
            return current_stream()
        if kind in BUFFER_DTYPES:
            if value is None:
                value = self._unused[kind]
            converted = self._converted.get(self._key(value, kind))
            return converted if converted is not None else to_cute(value, kind)
        return {"i32": Int32, "i64": Int64, "f32": Float32}[kind](0 if value is None else value)

    def _launch(self, name: str, **values) -> None:
        """Launch kernel ``name`` with the arguments named in ``values``. What is left out, the
        kernel's specialization never reads: a buffer becomes the stand-in of its kind, a scalar 0."""
        signature = self.plan[name].signature
        unknown = set(values) - {argument for argument, _ in signature}
        if unknown:
            raise TypeError(f"{name} has no argument(s) {sorted(unknown)}")
        if self.on_launch is not None:
            self.on_launch(name, self._ctas(name, values.get("num_tokens", 1)))
        self.compiled[name](*[self._argument(kind, values.get(argument)) for argument, kind in signature])

    def _ctas(self, name: str, num_tokens: int) -> int:
        kernel = self.plan[name].kernel
        tokens = max(1, -(-num_tokens // self.spec.tp)) if name.startswith("owner_reduce") else num_tokens
        return tokens * (getattr(kernel, "ctas", None) or getattr(kernel, "ctas_per_token", 1))

    def load_modules(self) -> None:
        """Load every compiled kernel into this device's context now (CuTe DSL loads a kernel's
        library at its first launch otherwise, and the driver the kernel at its first use)."""
        self._functions = {name: loaded_function(compiled) for name, compiled in self.compiled.items()}

    def footprint(self, name: str) -> tuple[object, int, int]:
        """(CUfunction, threads per CTA, dynamic shared bytes) of a compiled kernel, for occupancy."""
        if name not in self._functions:
            self.load_modules()
        kernel = self.plan[name].kernel
        slots = getattr(kernel, "smem_slots", None) or getattr(kernel, "slots", 0)
        shared = 4 * slots if getattr(kernel, "norm", False) else 0
        return self._functions[name], kernel.threads, shared

    # -- the Kernels interface ---------------------------------------------------------------------
    def publish(self, protocol: str, x: torch.Tensor) -> None:
        mailbox = self.workspace.contributions(protocol)
        self._launch(f"publish_{protocol}", x=x, state=self.workspace.state(protocol), peer_table=mailbox.peers,
                     multicast_address=mailbox.multicast, slots=self.spec.slots(protocol), num_tokens=x.shape[0])

    def finalize_publish(self, protocol: str, gemm2, weights, indices, shared) -> None:
        mailbox = self.workspace.contributions(protocol)
        self._launch(f"finalize_publish_{protocol}", x=shared, gemm2=gemm2, weights=weights, indices=indices,
                     state=self.workspace.state(protocol), peer_table=mailbox.peers,
                     multicast_address=mailbox.multicast, slots=self.spec.slots(protocol), num_tokens=shared.shape[0])

    def owner_reduce(self, m: int) -> None:
        ws = self.workspace
        self._launch("owner_reduce_bt", mailbox=ws.bt.local, sums_table=ws.bt_sums.peers,
                     sums_multicast_address=ws.bt_sums.multicast, state=ws.bt_state, error=ws.error,
                     num_tokens=m, timeout_ns=self.spec.spin_timeout_ns, slots=self.spec.owner_capacity,
                     capacity=self.spec.rows("bt"))

    def form(self, m: int) -> str:
        """The name prefix of the consumer form a call of ``m`` rows takes ("" is the cluster form)."""
        return "" if m <= self.split_rows else STREAMING

    def consume(self, protocol: str, args: ConsumerArgs) -> None:
        m = args.residual.shape[0]
        self._launch(f"{self.form(m)}consumer_{protocol}_{args.variant}", **self._consumer_values(protocol, args))

    def local(self, call: Call) -> None:
        args = call.consumer
        if call.kind == "finalize":
            name, contribution = "local_finalize", dict(x=call.shared, gemm2=call.gemm2, weights=call.weights,
                                                        indices=call.indices)
        else:
            name, contribution = "local", dict(x=call.x)
        spec = self.spec
        streamed = streams_past_l2(call.variant, call.m, spec.hidden, spec.hc, spec.top_k, self.l2_bytes,
                                   self.streamed_rows)
        self._launch(f"{self.form(call.m)}{name}_{args.variant}", residual=args.residual, post=args.post,
                     comb=args.comb, pre=args.pre, gamma=args.norm_weight, residual_out=args.residual_out,
                     layer_out=args.layer_input, values=args.mxfp8_values, scales=args.mxfp8_scales,
                     eps=float(args.norm_eps), num_tokens=call.m, streamed=int(streamed), **contribution)

    def publish_and_consume(self, call: Call, phases: str = "both") -> None:
        if phases != "both":
            raise ValueError("the CuTe DSL one-kernel form runs whole on a GPU; its halves exist only in the "
                             "Triton interpreter's simulated group")
        args, ws = call.consumer, self.workspace
        if call.kind == "finalize":
            name, publish = f"one_kernel_finalize_ll_{args.variant}", dict(
                x=call.shared, gemm2=call.gemm2, weights=call.weights, indices=call.indices)
        else:
            name, publish = f"one_kernel_ll_{args.variant}", dict(x=call.x)
        self._launch(name, **self._consumer_values("ll", args), **publish, peer_table=ws.ll.peers,
                     multicast_address=ws.ll.multicast)

    def _consumer_values(self, protocol: str, args: ConsumerArgs) -> dict:
        ws = self.workspace
        return dict(mailbox=ws.bt_sums.local if protocol == "bt" else ws.ll.local, residual=args.residual,
                    post=args.post, comb=args.comb, pre=args.pre, gamma=args.norm_weight,
                    residual_out=args.residual_out, layer_out=args.layer_input, values=args.mxfp8_values,
                    scales=args.mxfp8_scales, state=ws.state(protocol), error=ws.error, eps=float(args.norm_eps),
                    num_tokens=args.residual.shape[0], timeout_ns=self.spec.spin_timeout_ns,
                    capacity=self.spec.rows(protocol))
