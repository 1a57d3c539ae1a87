"""The CuTe DSL kernels of one build: which kernel object, with which runtime signature. Names match
``kernels_triton.plan`` for every kernel both backends have; the launcher and the offline PTX
compiler both read this, so what ``ptx`` writes is what the GPU would run.

Consumers: ``consumer_{ll,bt}_{variant}`` and, where ``spec.ll_one_kernel_rows > 0``, LL's one-kernel
forms ``one_kernel_ll_{variant}`` and ``one_kernel_finalize_ll_{variant}``; a group of one (protocol
"local") has only ``local_{variant}`` and ``local_finalize_{variant}``. These are the cluster forms
(a token over several CTAs, for few rows); each consumer of many rows has a streaming twin (a CTA per
token), named with the prefix ``streaming_`` (``streaming_consumer_bt_quant``, ``streaming_local_plain``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lamport_mhc.backend import BuildSpec

from .consumer import ConsumerKernel, LocalConsumerKernel
from .owner_reduce import OwnerReduceKernel
from .publish import PublishKernel
from .streaming import StreamingConsumerKernel, StreamingLocalConsumerKernel

STREAMING = "streaming_"  # name prefix of the streaming twin of a consumer

# Runtime arguments in order, by kind (see ``offline.fake_argument``):
#   "*i16" / "*fp32" / "*i32" / "*u8": 1-D device buffers of any length (bf16 data travels as int16 bits);
#   "state": int32 [3] generation state; "error": int32 [6]; "table": int64 [tp] of addresses;
#   "i32" / "i64" / "f32": scalars; "stream": the CUDA stream.
PUBLISH_SIGNATURE = (("x", "*i16"), ("gemm2", "*i16"), ("weights", "*fp32"), ("indices", "*i32"),
                     ("state", "state"), ("peer_table", "table"), ("multicast_address", "i64"),
                     ("slots", "i32"), ("num_tokens", "i32"), ("stream", "stream"))
OWNER_REDUCE_SIGNATURE = (("mailbox", "*i16"), ("sums_table", "table"), ("sums_multicast_address", "i64"),
                          ("state", "state"), ("error", "error"), ("num_tokens", "i32"), ("timeout_ns", "i64"),
                          ("slots", "i32"), ("capacity", "i32"), ("stream", "stream"))
CONSUMER_SIGNATURE = (("mailbox", "*i16"), ("residual", "*i16"), ("post", "*fp32"), ("comb", "*fp32"),
                      ("pre", "*fp32"), ("gamma", "*i16"), ("residual_out", "*i16"), ("layer_out", "*i16"),
                      ("values", "*u8"), ("scales", "*u8"), ("state", "state"), ("error", "error"), ("eps", "f32"),
                      ("num_tokens", "i32"), ("timeout_ns", "i64"), ("capacity", "i32"),
                      # one-kernel LL forms only, as the publish's
                      ("x", "*i16"), ("gemm2", "*i16"), ("weights", "*fp32"), ("indices", "*i32"),
                      ("peer_table", "table"), ("multicast_address", "i64"), ("stream", "stream"))
# A group of one's consumer: the call's inputs and outputs, no mailbox, state, error word or table;
# ``streamed`` (nonzero): the streaming form accesses what the call moves once evict-first in L2.
LOCAL_SIGNATURE = (("residual", "*i16"), ("post", "*fp32"), ("comb", "*fp32"), ("pre", "*fp32"), ("gamma", "*i16"),
                   ("residual_out", "*i16"), ("layer_out", "*i16"), ("values", "*u8"), ("scales", "*u8"),
                   ("eps", "f32"), ("num_tokens", "i32"), ("x", "*i16"), ("gemm2", "*i16"), ("weights", "*fp32"),
                   ("indices", "*i32"), ("streamed", "i32"), ("stream", "stream"))


@dataclass(frozen=True)
class CuteKernelInstance:
    name: str           # file-name friendly: kernel, protocol (and variant)
    kernel: object      # the kernel object ``cute.compile`` takes
    signature: tuple    # runtime arguments, in order: (name, kind)


def kernel_plan(spec: BuildSpec) -> dict[str, CuteKernelInstance]:
    """Every CuTe DSL kernel of a build, keyed by name (e.g. ``publish_ll``, ``owner_reduce_bt``,
    ``consumer_ll_quant``, ``streaming_consumer_ll_quant``, ``local_finalize_plain``)."""
    multicast = spec.transport == "multicast"
    plan = {}
    for protocol in spec.protocols:
        if protocol == "local":
            for contribution, prefix in (("x", "local"), ("finalize", "local_finalize")):
                for variant in spec.variants:
                    shape = dict(hidden=spec.hidden, hc=spec.hc, variant=variant, contribution=contribution,
                                 use_pdl=spec.use_pdl, top_k=spec.top_k)
                    for name, kernel in ((f"{prefix}_{variant}", LocalConsumerKernel(**shape)),
                                         (f"{STREAMING}{prefix}_{variant}", StreamingLocalConsumerKernel(**shape))):
                        plan[name] = CuteKernelInstance(name, kernel, LOCAL_SIGNATURE)
            continue
        bt = protocol == "bt"
        for finalize in (False, True):
            name = f"{'finalize_' if finalize else ''}publish_{protocol}"
            plan[name] = CuteKernelInstance(name, PublishKernel(
                hidden=spec.hidden, tp=spec.tp, rank=spec.rank, top_k=spec.top_k, finalize=finalize, bt=bt,
                multicast=multicast and not bt, use_pdl=spec.use_pdl), PUBLISH_SIGNATURE)
        if bt:
            plan["owner_reduce_bt"] = CuteKernelInstance("owner_reduce_bt", OwnerReduceKernel(
                hidden=spec.hidden, tp=spec.tp, rank=spec.rank, multicast=multicast, use_pdl=spec.use_pdl),
                OWNER_REDUCE_SIGNATURE)
        consumers = {"consumer": None}
        if not bt and spec.ll_one_kernel_rows > 0:
            consumers.update({"one_kernel": "x", "one_kernel_finalize": "finalize"})
        for prefix, contribution in consumers.items():
            for variant in spec.variants:
                name = f"{prefix}_{protocol}_{variant}"
                # Only a one-kernel form publishes, so only it depends on the rank.
                plan[name] = CuteKernelInstance(name, ConsumerKernel(
                    hidden=spec.hidden, hc=spec.hc, tp=spec.tp, variant=variant, protocol=protocol,
                    use_pdl=spec.use_pdl, contribution=contribution, rank=0 if contribution is None else spec.rank,
                    top_k=spec.top_k,
                    multicast=multicast), CONSUMER_SIGNATURE)
        for variant in spec.variants:
            name = f"{STREAMING}consumer_{protocol}_{variant}"
            plan[name] = CuteKernelInstance(name, StreamingConsumerKernel(
                hidden=spec.hidden, hc=spec.hc, tp=spec.tp, variant=variant, protocol=protocol,
                use_pdl=spec.use_pdl), CONSUMER_SIGNATURE)
    return plan
