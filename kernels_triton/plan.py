"""The compiled kernels of one build: which kernel, with which constexprs, signature and launch
options. The launcher and the offline PTX compiler both read this, so what ``ptx`` writes is what
the GPU runs."""

from __future__ import annotations

from dataclasses import dataclass

from lamport_mhc.backend import BuildSpec

from .consumer import (BOTH_PHASES, NO_PUBLISH, PLAIN, PUBLISH_FINALIZE, PUBLISH_X, QUANT, RESIDUAL_ONLY, consumer_kernel)
from .owner_reduce import owner_reduce_kernel
from .publish import publish_kernel

VARIANT_CODES = {"plain": PLAIN.value, "quant": QUANT.value, "residual": RESIDUAL_ONLY.value}

PUBLISH_SIGNATURE = {"x_ptr": "*i16", "gemm2_ptr": "*i16", "weights_ptr": "*fp32", "indices_ptr": "*i32",
                     "state_ptr": "*i32", "peer_table_ptr": "*i64", "multicast_address": "i64", "slots": "i32"}
OWNER_REDUCE_SIGNATURE = {"mailbox_ptr": "*i16", "sums_table_ptr": "*i64", "sums_multicast_address": "i64",
                          "state_ptr": "*i32", "error_ptr": "*i32", "num_tokens": "i32", "timeout_ns": "i64",
                          "slots": "i32", "capacity": "i32"}
CONSUMER_SIGNATURE = {"mailbox_ptr": "*i16", "residual_ptr": "*i16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                      "pre_ptr": "*fp32", "gamma_ptr": "*i16", "residual_out_ptr": "*i16",
                      "layer_out_ptr": "*i16", "values_ptr": "*u8", "scales_ptr": "*u8", "state_ptr": "*i32",
                      "error_ptr": "*i32", "eps": "fp32", "num_tokens": "i32", "timeout_ns": "i64",
                      "capacity": "i32", "x_ptr": "*i16", "gemm2_ptr": "*i16", "weights_ptr": "*fp32",
                      "indices_ptr": "*i32", "peer_table_ptr": "*i64", "multicast_address": "i64"}


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_width(hidden: int) -> int:
    """Largest power of two (<= 1024) dividing ``hidden``: publish and owner-reduce programs cover
    whole 16-byte fragments with no masked lane."""
    return min(hidden & -hidden, 1024)


def consumer_warps(block_h: int) -> int:
    return 4 if block_h <= 1024 else 8 if block_h <= 4096 else 16


@dataclass(frozen=True)
class KernelInstance:
    name: str            # file-name friendly: kernel, protocol and variant
    fn: object           # the DualFunction
    constexprs: dict
    signature: dict      # runtime arguments, in order
    num_warps: int


def kernel_plan(spec: BuildSpec, on_gpu: bool = True) -> dict[str, KernelInstance]:
    """Every kernel a build launches, keyed by name (e.g. ``publish_ll``, ``consumer_bt_quant``)."""
    multicast = spec.transport == "multicast"
    common = dict(HIDDEN=spec.hidden, TP=spec.tp, ON_GPU=on_gpu, USE_PDL=spec.use_pdl and on_gpu)
    block = chunk_width(spec.hidden)
    plan = {}
    for protocol in spec.protocols:
        bt = protocol == "bt"
        for finalize in (False, True):
            name = f"{'finalize_' if finalize else ''}publish_{protocol}"
            plan[name] = KernelInstance(name, publish_kernel, dict(
                common, RANK=spec.rank, TOP_K=spec.top_k, BLOCK=block, FINALIZE=finalize, BT=bt, MULTICAST=multicast and not bt),
                PUBLISH_SIGNATURE, 4)
        if bt:
            plan["owner_reduce_bt"] = KernelInstance("owner_reduce_bt", owner_reduce_kernel, dict(
                common, RANK=spec.rank, BLOCK=block,
                MULTICAST=multicast), OWNER_REDUCE_SIGNATURE, 4)
        block_h = _pow2_at_least(spec.hidden)
        consumers = {"consumer": NO_PUBLISH}
        if not bt and spec.ll_one_kernel_rows > 0:
            consumers.update({"one_kernel": PUBLISH_X, "one_kernel_finalize": PUBLISH_FINALIZE})
        for prefix, publish in consumers.items():
            for variant in spec.variants:
                name = f"{prefix}_{protocol}_{variant}"
                plan[name] = KernelInstance(name, consumer_kernel, dict(
                    common, HC=spec.hc, RANK=spec.rank, TOP_K=spec.top_k, BLOCK_H=block_h,
                    BLOCK_HC=_pow2_at_least(spec.hc), CHUNK=block, REDUCED=bt, VARIANT=VARIANT_CODES[variant],
                    PUBLISH=publish.value, PHASES=BOTH_PHASES.value, MULTICAST=multicast),
                    CONSUMER_SIGNATURE, consumer_warps(block_h))
    return plan
