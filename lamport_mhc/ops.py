"""``AllReduceMHC`` as torch custom ops, so a model calling it traces under ``torch.compile`` (no graph
break) and records into CUDA graphs like any other op.

- ``torch.ops.lamport_mhc.all_reduce_mhc(handle, x, residual, post, comb, pre, norm_weight, norm_eps)
  -> (residual_out, layer_input)``
- ``torch.ops.lamport_mhc.all_reduce_mhc_finalize(handle, gemm2_permuted, expert_weights,
  expanded_idx_to_permuted_idx, shared_output, residual, post, comb, pre, norm_weight, norm_eps)
  -> (residual_out, layer_input)``
- ``all_reduce_mhc_quant`` / ``all_reduce_mhc_finalize_quant``: the same plus ``mxfp8_values,
  mxfp8_scales``, written in place (declared in ``mutates_args``).

A schema holds tensors and scalars, not Python objects, so the instance travels as ``handle``: the
int ``register`` returned for it. The outputs are new tensors. Every op is marked side-effecting, so a
compiled graph keeps each call even where its outputs are unused (the quant ops are separate ops
because a mutable schema whose optional buffers are None is dropped like a pure op). Residual-only
calls are not exposed as ops.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch
from torch.fx.node import has_side_effect

if TYPE_CHECKING:
    from .api import AllReduceMHC

# Weak values: the registry never keeps a dropped instance (and its workspace) alive.
_INSTANCES: weakref.WeakValueDictionary[int, AllReduceMHC] = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


def register(op: AllReduceMHC) -> int:
    """A handle for ``op`` to pass to the custom ops (valid while ``op`` is alive)."""
    handle = next(_NEXT_HANDLE)
    _INSTANCES[handle] = op
    return handle


def lookup(handle: int) -> AllReduceMHC:
    try:
        return _INSTANCES[handle]
    except KeyError:
        raise RuntimeError(f"lamport_mhc op handle {handle} is not registered (the AllReduceMHC it named "
                           f"was dropped or never registered)") from None


@torch.library.custom_op("lamport_mhc::all_reduce_mhc", mutates_args=())
def all_reduce_mhc(handle: int, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   pre: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return lookup(handle)(x, residual, post, comb, pre, norm_weight, norm_eps)


@all_reduce_mhc.register_fake
def _all_reduce_mhc_fake(handle, x, residual, post, comb, pre, norm_weight, norm_eps):
    return torch.empty_like(residual), torch.empty_like(x)


@torch.library.custom_op("lamport_mhc::all_reduce_mhc_quant", mutates_args=("mxfp8_values", "mxfp8_scales"))
def all_reduce_mhc_quant(handle: int, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                         comb: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
                         mxfp8_values: torch.Tensor, mxfp8_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return lookup(handle)(x, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out=(mxfp8_values, mxfp8_scales))


@all_reduce_mhc_quant.register_fake
def _all_reduce_mhc_quant_fake(handle, x, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_values,
                               mxfp8_scales):
    return torch.empty_like(residual), torch.empty_like(x)


@torch.library.custom_op("lamport_mhc::all_reduce_mhc_finalize", mutates_args=())
def all_reduce_mhc_finalize(handle: int, gemm2_permuted: torch.Tensor, expert_weights: torch.Tensor,
                            expanded_idx_to_permuted_idx: torch.Tensor, shared_output: torch.Tensor,
                            residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                            norm_weight: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return lookup(handle).finalize(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output,
                                   residual, post, comb, pre, norm_weight, norm_eps)


@all_reduce_mhc_finalize.register_fake
def _all_reduce_mhc_finalize_fake(handle, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                                  shared_output, residual, post, comb, pre, norm_weight, norm_eps):
    return torch.empty_like(residual), torch.empty_like(shared_output)


@torch.library.custom_op("lamport_mhc::all_reduce_mhc_finalize_quant", mutates_args=("mxfp8_values", "mxfp8_scales"))
def all_reduce_mhc_finalize_quant(handle: int, gemm2_permuted: torch.Tensor, expert_weights: torch.Tensor,
                                  expanded_idx_to_permuted_idx: torch.Tensor, shared_output: torch.Tensor,
                                  residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre: torch.Tensor,
                                  norm_weight: torch.Tensor, norm_eps: float, mxfp8_values: torch.Tensor,
                                  mxfp8_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return lookup(handle).finalize(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output,
                                   residual, post, comb, pre, norm_weight, norm_eps,
                                   mxfp8_out=(mxfp8_values, mxfp8_scales))


@all_reduce_mhc_finalize_quant.register_fake
def _all_reduce_mhc_finalize_quant_fake(handle, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                                        shared_output, residual, post, comb, pre, norm_weight, norm_eps,
                                        mxfp8_values, mxfp8_scales):
    return torch.empty_like(residual), torch.empty_like(shared_output)


# A call is a collective step every rank must take (it advances the Lamport generations), so a compiler
# must not drop one whose outputs go unused.
OPS = (torch.ops.lamport_mhc.all_reduce_mhc.default, torch.ops.lamport_mhc.all_reduce_mhc_quant.default,
       torch.ops.lamport_mhc.all_reduce_mhc_finalize.default,
       torch.ops.lamport_mhc.all_reduce_mhc_finalize_quant.default)
for _op in OPS:
    has_side_effect(_op)
