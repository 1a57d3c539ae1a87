"""A validated call: its inputs and the outputs it writes, shared by every path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import ConsumerArgs


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
