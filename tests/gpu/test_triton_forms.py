"""Every local form of the Triton backend on one GPU, each forced on every call
(``lamport_mhc.bench.local_forms.FormForcer``), hinted and not: the calls of x (plain, quant) and the
finalize from one row to past a wave, at the model sizes, bit-exact with the reference (NaN, Inf and
-0.0 inputs included). The measured windows send each form only some rows (test_fused_backends'
sweep); here every form meets every M, the forms that no window takes yet included (the broad held
twin). Each launch is recorded: where the plan has the forced form, it is the one launched.

    timeout 900 python -m pytest -q tests/gpu/test_triton_forms.py
"""

import pytest
import torch

from .bodies import build, check, require_backend, special_values
from .harness import require_gpus, run_ranks

CAPACITY = 1024
SIZES = (1, 7, 130, 255, 600)
VARIANTS = ("plain", "quant", "finalize")
# The kernel name's suffix of each forced form, and the forms that have a hinted twin.
SUFFIXES = {"cooperative": "_split", "parked": "", "wide": "_wide", "held": "_held", "broad": "_broad",
            "broad-held": "_broad_held"}
HINTED_TWINS = ("", "_wide", "_broad_held")


def _expected_kernel(variant: str, form: str, hinted: bool) -> str:
    """The kernel a forced call must launch where the plan has it (the cooperative form: its stem,
    past its resident clusters its capped twin)."""
    consumer = "local_finalize_plain" if variant == "finalize" else f"local_{variant}"
    suffix = SUFFIXES[form]
    return consumer + suffix + ("_streamed" if hinted and suffix in HINTED_TWINS else "")


def _forms_body(rank, tp, hidden):
    from lamport_mhc.bench.local_forms import FORMS, FormForcer

    assert set(FORMS) == set(SUFFIXES), "a new form needs its suffix here"
    op = build(hidden, CAPACITY, "triton", None)
    kernels = op.path.kernels["triton"]
    forcer = FormForcer(kernels)
    launched = []
    kernels.on_launch = lambda name, programs: launched.append(name)
    failures = []
    for f, form in enumerate(FORMS):
        for hinted in (False, True):
            forcer.force(form, hinted)
            for m in SIZES:
                for v, variant in enumerate(VARIANTS):
                    launched.clear()
                    seed = hidden * 1000 + f * 100 + hinted * 50 + SIZES.index(m) * 5 + v
                    failures += check([op], 1, rank, m, hidden, variant, seed,
                                      edit=special_values if m >= 3 else None)
                    expected = _expected_kernel(variant, form, hinted)
                    local_x = variant != "finalize"
                    forced = local_x or form in ("cooperative", "parked", "wide")  # windows the finalize shares
                    took = launched[-1].startswith(expected) if form == "cooperative" else launched[-1] == expected
                    if forced and expected in kernels.plan and not took:
                        failures.append(f"H={hidden} M={m} {variant} {form} hinted={hinted}: launched {launched}, "
                                        f"expected {expected}")
    forcer.reset()
    kernels.on_launch = None
    torch.cuda.synchronize()
    op.check()
    return failures


@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
def test_every_forced_local_form_gives_the_references_bits(hidden):
    require_gpus(1)
    require_backend("triton")
    failures = [f for rank_failures in run_ranks(_forms_body, 1, args=(hidden,), timeout_s=500)
                for f in rank_failures]
    assert not failures, f"{len(failures)} wrong calls:\n" + "\n".join(failures[:40])
