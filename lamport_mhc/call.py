"""A validated call: its inputs and the outputs it writes, shared by every path."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from .backend import ConsumerArgs
from .layout import SCALE_TILE_ROWS
from .mxfp8 import mxfp8_scale_bytes


@dataclass
class Call:
    kind: str                        # "plain" | "finalize"
    m: int
    consumer: ConsumerArgs
    x: torch.Tensor | None = None    # plain
    gemm2: torch.Tensor | None = None  # finalize
    weights: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    shared: torch.Tensor | None = None

    @property
    def variant(self) -> str:
        """The benchmark variant a call measures as: "finalize", "quant" (MXFP8 out) or "plain"."""
        if self.kind == "finalize":
            return "finalize"
        return "quant" if self.consumer.mxfp8_values is not None else "plain"

    @property
    def outputs(self) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        c = self.consumer
        mxfp8 = None if c.mxfp8_values is None else (c.mxfp8_values, c.mxfp8_scales)
        return c.residual_out, c.layer_input, mxfp8

    def rows(self, start: int, stop: int) -> Call:
        """The call of rows [start, stop) alone: its inputs and outputs are views of this call's
        (the MXFP8 scales: the bytes of those rows' 128-row tiles, so ``start`` must begin one)."""
        def part(tensor):
            return None if tensor is None else tensor[start:stop]
        c = self.consumer
        scales = c.mxfp8_scales
        if scales is not None:
            if start % SCALE_TILE_ROWS:
                raise ValueError(f"a part of an MXFP8 call starts on a {SCALE_TILE_ROWS}-row tile, not at row {start}")
            hidden = c.residual.shape[-1]
            first = start // SCALE_TILE_ROWS * mxfp8_scale_bytes(1, hidden)
            scales = scales[first:first + mxfp8_scale_bytes(stop - start, hidden)]
        consumer = replace(c, residual=part(c.residual), post=part(c.post), comb=part(c.comb), pre=part(c.pre),
                           residual_out=part(c.residual_out), layer_input=part(c.layer_input),
                           mxfp8_values=part(c.mxfp8_values), mxfp8_scales=scales)
        return replace(self, m=stop - start, consumer=consumer, x=part(self.x), weights=part(self.weights),
                       indices=part(self.indices), shared=part(self.shared))

    def parts(self, rows: int) -> Iterator[Call]:
        """This call as consecutive parts of at most ``rows`` rows (itself when it fits)."""
        if self.m <= rows:
            yield self
            return
        for start in range(0, self.m, rows):
            yield self.rows(start, min(start + rows, self.m))
