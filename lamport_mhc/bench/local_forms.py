"""Forcing the Triton backend's local forms, one at a time, for measuring where each is fastest.

The windows of rows that send a local call to the cooperative, parked, wide, held, broad or broad
held form (``kernels_triton.backend``: ``LOCAL_X_*_ROWS_PER_SM``) are measured by timing every form
at the same rows in one run; ``bench/local_forms.py`` does so on a GPU, against the strong tail's forms.
``FormForcer`` sets a build's windows so that every local call takes one form (where its plan has
it; otherwise the calls keep the form they would take), hinted or not, and puts the measured
windows back. The probe scripts (``bench/local_forms.py``, ``bench/profile_forms.py``) share the
build they call (``probe_op``), the rows they draw (``row_inputs``), the record of what a call
launched (``kernel_launched``) and their command line's rows and forms (``row_parser``,
``parse_fused``, ``parse_strong``). ``ColdRows`` gives a cold graph its calls' inputs.
"""

from __future__ import annotations

import argparse
import itertools

from kernels_triton.backend import UNBOUNDED

HC, TOP_K, EPS = 4, 6, 1e-6  # the probes' streams, routes and norm epsilon

# Form -> which windows hold every call (True), none (False), or stay as derived (absent).
FORMS = {
    "cooperative": dict(split=True, broad=False, broad_held=False),
    "parked": dict(split=False, wide=False, held=False, broad=False, broad_held=False),
    "wide": dict(split=False, wide=True, held=False, broad=False, broad_held=False),
    "held": dict(split=False, wide=False, held=True, broad=False, broad_held=False),
    "broad": dict(broad=True, broad_held=False),
    "broad-held": dict(broad_held=True),
}


class FormForcer:
    """Forces the local forms of one ``TritonKernels`` (``force``); ``reset`` derives its windows
    again (``derive_bounds``) and gives back its L2 size."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.l2_bytes = kernels.l2_bytes

    def reset(self) -> None:
        self.kernels.derive_bounds()
        self.kernels.l2_bytes = self.l2_bytes

    def force(self, form: str, hinted: bool | None = None) -> None:
        """Every local call takes ``form`` (``FORMS``) where the plan has it; ``hinted``: with the
        cache hints (True), without (False), or as the call's traffic decides (None)."""
        if form not in FORMS:
            raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}")
        self.reset()
        k, windows = self.kernels, FORMS[form]
        every, nothing = ((0, UNBOUNDED),), ()
        if "split" in windows:
            k.local_split_windows = {key: every if windows["split"] else nothing for key in k.local_split_windows}
        if "wide" in windows:  # (at most, at least): every call, or none
            k.wide_rows = {key: (UNBOUNDED, UNBOUNDED) if windows["wide"] else (-1, UNBOUNDED) for key in k.wide_rows}
            k.local_x_parked_windows = {variant: nothing for variant in k.local_x_parked_windows}
        if "held" in windows:
            k.held_rows = 0 if windows["held"] else UNBOUNDED
            k.local_x_held_windows = {variant: nothing for variant in k.local_x_held_windows}
        if "broad" in windows:
            k.local_x_broad_windows = {variant: every if windows["broad"] else nothing
                                       for variant in k.local_x_broad_windows}
        if "broad_held" in windows:  # hinted or not as ``hinted`` says, below
            k.local_x_broad_held_windows = {variant: every if windows["broad_held"] else nothing
                                            for variant in k.local_x_broad_held_windows}
            k.local_x_hinted_broad_held_windows = {variant: nothing for variant in k.local_x_hinted_broad_held_windows}
        if hinted is not None:
            k.local_x_hinted_wide_rows = {variant: 0 for variant in k.local_x_hinted_wide_rows}
            # Every call moves at least 0 bytes of an L2 of 0; none is in an empty window.
            k.streamed_rows, k.l2_bytes = ((0, UNBOUNDED), 0) if hinted else ((0, 0), self.l2_bytes)


def row_parser(variants: tuple[str, ...]):
    """The parser of a probe's ``HIDDEN:VARIANT:M`` rows, of the given variants."""
    def parse_row(text: str) -> tuple[int, str, int]:
        hidden, variant, m = text.split(":")
        if variant not in variants:
            named = " or ".join(filter(None, (", ".join(variants[:-1]), variants[-1])))
            raise argparse.ArgumentTypeError(f"variant must be {named}, got {variant!r}")
        return int(hidden), variant, int(m)
    return parse_row


def parse_fused(text: str) -> list[str]:
    """Comma-separated fused forms: "auto" or a form of ``FORMS``, "-hinted" for its twin with the
    cache hints."""
    forms = text.split(",") if text else []
    for form in forms:
        if form != "auto" and form.removesuffix("-hinted") not in FORMS:
            raise argparse.ArgumentTypeError(f"fused forms are auto or {sorted(FORMS)} (+ -hinted), got {form!r}")
    return forms


def parse_strong(text: str) -> list[str]:
    """Comma-separated forms of the strong tail (``strong_tail.STRATEGIES``)."""
    from .strong_tail import STRATEGIES

    forms = text.split(",") if text else []
    for form in forms:
        if form not in STRATEGIES:
            raise argparse.ArgumentTypeError(f"strong forms are {STRATEGIES}, got {form!r}")
    return forms


def force_label(forcer: FormForcer, label: str) -> None:
    """Have ``forcer``'s build take the fused form ``label`` (``parse_fused``): "auto" puts the measured
    windows back."""
    if label == "auto":
        forcer.reset()
    else:
        forcer.force(label.removesuffix("-hinted"), label.endswith("-hinted"))


def probe_op(hidden: int, rows, device, use_pdl: bool = True):
    """The Triton build a probe calls at ``hidden``: room for the largest of its ``rows``
    (``HIDDEN, VARIANT, M``) of that size, at least one scale tile (128)."""
    from .. import AllReduceMHC, AllReduceMHCConfig

    capacity = max(128, *(m for h, _, m in rows if h == hidden))
    return AllReduceMHC(hidden, HC, capacity, TOP_K, device, quantize_layer_input=True,
                        config=AllReduceMHCConfig(backend="triton", use_pdl=use_pdl))


def kernel_launched(kernels, call):
    """Run ``call``: its result, and the name of the last kernel it launched on ``kernels``."""
    launched = []
    kernels.on_launch = lambda name, programs: launched.append(name)
    try:
        result = call()
    finally:
        kernels.on_launch = None
    return result, launched[-1]


def row_inputs(hidden: int, variant: str, m: int, device, hc: int = HC, top_k: int = TOP_K, eps: float = EPS,
               specials: bool = False):
    """A timed row's inputs, drawn on ``device`` (seeded by ``m``, finite as a model's unless
    ``specials``, no zero row, the finalize's routes permuted): (x, the consumer's arguments from the
    streams to eps, the MXFP8 outputs or None, the finalize's inputs or None)."""
    import torch

    from ..mxfp8 import mxfp8_scale_bytes
    from ..testing import random_inputs

    inputs = random_inputs(1, m, hidden, hc, seed=m, top_k=top_k if variant == "finalize" else 0, permuted=True,
                           zero_row=False, specials=specials, device=device, drawn_on_device=True)
    consumer = (inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], eps)
    mxfp8 = None
    if variant == "quant":
        mxfp8 = (torch.empty((m, hidden), dtype=torch.float8_e4m3fn, device=device),
                 torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device))
    finalize = None
    if variant == "finalize":
        finalize = (inputs["gemm2s"][0], inputs["weights"][0], inputs["idxs"][0], inputs["shareds"][0])
    return inputs["xs"][0], consumer, mxfp8, finalize


class ColdRows:
    """The inputs of a cold graph's calls: ``count`` copies of a row's inputs (``row_inputs``), one per
    call in turn (``next``), so many that together with the call's outputs they take ``L2_MULTIPLE``
    times the L2 (``cold_count``): the calls since a copy was last read have moved at least 1.5 L2s,
    so a call finds its inputs in HBM, as an engine's call does after the layers between two of its
    calls. Not so where a copy for every call of the graph is not enough (H 4096, 50 calls: below
    about 40 rows); and the outputs, allocated by every call, may take the same blocks call after call."""

    L2_MULTIPLE = 3

    def __init__(self, row: tuple, count: int, draw):
        self.rows = [row] + [draw() for _ in range(count - 1)]
        self._turns = itertools.cycle(self.rows)

    @staticmethod
    def row_bytes(row: tuple) -> int:
        """A call's bytes in HBM: its inputs (``row_inputs``' tuple) and the outputs it allocates (the
        residual streams' and the layer input's)."""
        x, consumer, mxfp8, finalize = row
        tensors = [x, *consumer, *(mxfp8 or ()), *(finalize or ()), consumer[0], x]
        return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))

    @classmethod
    def cold_count(cls, row_bytes: int, l2_bytes: int, calls: int) -> int:
        """Copies a graph of ``calls`` calls cycles: at least two, at most one a call."""
        return max(2, min(calls, -(-cls.L2_MULTIPLE * l2_bytes // row_bytes)))

    def next(self) -> tuple:
        return next(self._turns)
