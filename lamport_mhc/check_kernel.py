"""A soak's bit comparison on the device: one launch per output, in the stream order of the call
it checks, so thousands of calls are compared without a host synchronization (CPU ranks: the same
in torch ops)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
POISON = {torch.int32: -0x5A5A5A5B, torch.uint8: 0xA5}  # every byte 0xA5


# Specialized on nothing that changes from call to call: a new specialization compiles on the host,
# and a host stalled past the spin bound while its peers spin fails the soak for nothing.
@triton.jit(do_not_specialize=["n", "m", "count_ptr", "first_ptr", "call_id"])
def _check_and_poison(out_ptr, ref_ptr, row_ptr, n, m, count_ptr, first_ptr, call_id, POISON_VALUE: tl.constexpr,
                      BY_ROW: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    out = tl.load(out_ptr + offsets, mask=mask, other=0)
    ref = tl.load(ref_ptr + offsets, mask=mask, other=0)
    if BY_ROW:  # the reference at capacity rows, zero where the call has no row (padded scales)
        ref = tl.where(tl.load(row_ptr + offsets, mask=mask, other=0) < m, ref, tl.zeros_like(ref))
    wrong = tl.sum(((out != ref) & mask).to(tl.int32), axis=0)
    if wrong > 0:
        tl.atomic_add(count_ptr, wrong.to(tl.int64))
        tl.atomic_min(first_ptr, call_id)
    tl.store(out_ptr + offsets, tl.full([BLOCK], POISON_VALUE, out_ptr.dtype.element_ty), mask=mask)


def check_and_poison(out: torch.Tensor, ref: torch.Tensor, row_of: torch.Tensor | None, m: int,
                     count: torch.Tensor, first: torch.Tensor, call_id: int) -> None:
    """Count the words of ``out`` that differ from the first words of ``ref`` into ``count[0]``
    (int64), lower ``first[0]`` to ``call_id`` if any does, then poison ``out``. ``row_of``: for
    the swizzled scales, the row of every byte (the reference holds zero past row ``m``)."""
    dtype = torch.uint8 if row_of is not None or out.numel() * out.element_size() % 4 else torch.int32
    out_words, ref_words = out.reshape(-1).view(dtype), ref.reshape(-1).view(dtype)
    n = out_words.numel()
    if ref_words.numel() < n:
        raise ValueError(f"the reference holds {ref_words.numel()} words, the output {n}")
    if out.device.type != "cuda":  # CPU ranks (gloo): the same comparison in torch ops
        expected = ref_words[:n] if row_of is None else torch.where(row_of[:n] < m, ref_words[:n], 0).to(dtype)
        wrong = int((out_words != expected).sum())
        if wrong:
            count[0] += wrong
            first[0] = min(int(first[0]), call_id)
        out_words.fill_(POISON[dtype])
        return
    _check_and_poison[(triton.cdiv(n, BLOCK),)](out_words, ref_words, out_words if row_of is None else row_of, n, m,
                                                count, first, call_id, POISON_VALUE=POISON[dtype],
                                                BY_ROW=row_of is not None, BLOCK=BLOCK)
