"""lamport-mhc: a Lamport tensor-parallel all-reduce fused with the mHC post-mix, pre-mix collapse,
RMSNorm and an optional MXFP8 copy of the layer input, for DeepSeek-V4.1-style models."""

from .config import AllReduceMHCConfig
from .mxfp8 import mxfp8_scale_bytes
from .api import AllReduceMHC
from .simulate import SimulatedGroup

__all__ = ["AllReduceMHC", "AllReduceMHCConfig", "SimulatedGroup", "mxfp8_scale_bytes"]

