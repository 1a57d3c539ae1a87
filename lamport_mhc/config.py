"""User-facing configuration of an ``AllReduceMHC`` build."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from .backend import ALL_BACKENDS, TRANSPORTS

BACKEND_ENV = "LAMPORT_MHC_BACKEND"
BACKEND_CHOICES = ("auto",) + ALL_BACKENDS
TRANSPORT_CHOICES = ("auto",) + TRANSPORTS


@dataclass(frozen=True)
class AllReduceMHCConfig:
    """backend: "auto" (the measured preference among what this machine supports, else "torch"),
    "triton", "cute" or "torch" (unfused: gather + torch ops, any process group). The environment
    variable LAMPORT_MHC_BACKEND overrides it.
    transport: "auto" (multicast where the symmetric-memory handle has a multicast address and
    TORCH_SYMM_MEM_DISABLE_MULTICAST is unset, else peer), "peer" or "multicast".
    bt_min_rows / bt_min_finalize_rows: calls of at least this many rows use the two-shot BT
    protocol; None takes the preset of this machine (``lamport_mhc.presets``).
    cross_check: also run ``cross_check_backend`` on every call and raise on the first differing bit.
    spin_timeout_ms: bound every spin loop, turning a lost peer into a RuntimeError instead of a
    hang; cheap enough to keep on in production, CUDA graphs included. Cost: a clock read per poll
    iteration on the GPU; per call on the host, a read of pinned host memory (no copy, no
    synchronization; none at all while a graph is being captured). A poll that gives up records
    the rank, generation and token it waited for; the error surfaces at the first eager call (or
    ``check()``, which synchronizes first) made after the kernel that gave up has run, replayed
    graphs included, and never inside capture. Calls are asynchronous, so an eager call may still
    run behind a kernel that has not given up yet; the one after it raises. From then on the
    instance raises on every call: rebuild it on every rank. None: wait forever.
    ll_one_kernel_max_rows: LL calls of at most this many rows run as one kernel (publish and
    consumer fused; the lowest latency). None: the GPU's SM count, the most for which every program
    is resident at once, as each waits for its twins on the other ranks; 0: always two kernels.
    Ranks may differ: both forms write the same mailbox slots and advance the same generation.
    check_index_range: validate finalize's expert indices against the GEMM2 rows before launching
    (reads them on the host: a device synchronization per call, not allowed in graph capture).
    chunk_rows: the most rows one protocol round takes (a multiple of 128, MXFP8's scale tiles):
    a larger call goes through as consecutive parts of at most this many rows over the same
    mailboxes, bit for bit what one call would give. The mailboxes are sized to it, not to
    max_num_tokens (LL's to the rows below the BT thresholds). None: ``selector.CHUNK_ROWS``.
    presets_file: a presets file (``python -m lamport_mhc presets CSV --write PATH``) whose rows
    override the built-in presets; None: LAMPORT_MHC_PRESETS, else ~/.cache/lamport_mhc/presets.json
    where it exists (``lamport_mhc.presets``).
    construction_timeout_s: construction is collective; a rank waits at most this long for every
    rank of the group to begin the same construction, then raises naming the ranks that did not
    (``lamport_mhc.arrival``). None: wait for ever.
    """

    backend: str = "auto"
    transport: str = "auto"
    bt_min_rows: int | None = None
    bt_min_finalize_rows: int | None = None
    cross_check: bool = False
    cross_check_backend: str = "torch"
    spin_timeout_ms: float | None = None
    use_pdl: bool = True
    check_index_range: bool = False
    ll_one_kernel_max_rows: int | None = None
    presets_file: str | os.PathLike | None = None
    chunk_rows: int | None = None
    construction_timeout_s: float | None = 600.0

    def __post_init__(self):
        from .selector import check_chunk_rows

        if self.chunk_rows is not None:
            check_chunk_rows(self.chunk_rows, quantize=True)
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        if self.cross_check_backend not in ALL_BACKENDS:
            raise ValueError(f"cross_check_backend must be one of {ALL_BACKENDS}, got {self.cross_check_backend!r}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, got {self.transport!r}")
        for name in ("bt_min_rows", "bt_min_finalize_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        rows = self.ll_one_kernel_max_rows
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
            raise ValueError(f"ll_one_kernel_max_rows must be an int >= 0 or None, got {rows!r}")
        if self.presets_file is not None and not isinstance(self.presets_file, (str, os.PathLike)):
            raise ValueError(f"presets_file must be a path or None, got {self.presets_file!r}")
        for name in ("spin_timeout_ms", "construction_timeout_s"):
            _check_bound(name, getattr(self, name))

    @property
    def spin_timeout_ns(self) -> int:
        return 0 if self.spin_timeout_ms is None else max(1, int(self.spin_timeout_ms * 1e6))

    def with_environment(self) -> AllReduceMHCConfig:
        """The config with LAMPORT_MHC_BACKEND applied (an invalid value raises ValueError)."""
        override = os.environ.get(BACKEND_ENV, "").strip()
        if not override:
            return self
        if override not in BACKEND_CHOICES:
            raise ValueError(f"{BACKEND_ENV}={override!r}: expected one of {BACKEND_CHOICES}")
        return replace(self, backend=override)


def _check_bound(name: str, value) -> None:
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
