"""lamport-mhc: a Lamport tensor-parallel all-reduce fused with the mHC post-mix, pre-mix collapse,
RMSNorm and an optional MXFP8 copy of the layer input, for DeepSeek-V4.1-style models."""

from .config import AllReduceMHCConfig
from .mxfp8 import mxfp8_scale_bytes
from .simulate import SimulatedGroup

__all__ = ["AllReduceMHC", "AllReduceMHCConfig", "SimulatedGroup", "mxfp8_scale_bytes"]


def __getattr__(name):
    # The API module imports torch.distributed pieces; load it on first use.
    if name == "AllReduceMHC":
        from .api import AllReduceMHC
        return AllReduceMHC
    raise AttributeError(name)
