"""The command lines of bench/profile_forms.py and bench/local_forms.py, on the CPU: the rows and
forms they accept and the ones they refuse before they touch a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
from timer_stand_in import StandInTimer

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_forms.py"
PROBE = SCRIPT.parent / "local_forms.py"


def _run(script, *args):
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script,args,message", [
    (SCRIPT, ("--rows", "5120:finalize:100"), "variant must be plain or quant, got 'finalize'"),
    (PROBE, ("--rows", "5120:final:100"), "variant must be plain, quant or finalize, got 'final'"),
    (SCRIPT, ("--rows", "5120:quant:100", "--fused", "auto,roomy"), "fused forms are auto or"),
    (PROBE, ("--rows", "5120:quant:100", "--fused", "parked-streamed"), "fused forms are auto or"),
    (SCRIPT, ("--rows", "5120:quant:100", "--strong", "looped,fastest"), "strong forms are"),
    (PROBE, ("--rows", "5120:quant:100", "--strong", "looped,fastest"), "strong forms are"),
])
def test_bad_rows_and_forms_are_refused(script, args, message):
    result = _run(script, *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_every_form_the_forcer_has_is_accepted_hinted_or_not():
    from lamport_mhc.bench.local_forms import FORMS, parse_fused, parse_strong
    from lamport_mhc.bench.strong_tail import STRATEGIES

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import local_forms
        import profile_forms
    finally:
        sys.path.remove(str(SCRIPT.parent))
    forms = ["auto", *FORMS, *(f"{form}-hinted" for form in FORMS)]
    assert parse_fused(",".join(forms)) == forms
    assert sorted(parse_fused(local_forms.EVERY_FUSED_FORM)) == sorted(forms)  # the probe's default: every one
    assert parse_strong(",".join(STRATEGIES)) == list(STRATEGIES)
    assert profile_forms.parse_row("7168:plain:128") == (7168, "plain", 128)


def test_a_cold_row_gives_every_call_of_both_sides_its_own_copy_of_the_inputs(monkeypatch):
    """``measure_row(cold=True)`` on the CPU, its GPU parts replaced: the fused op's and the strong
    tail's calls take the copies in turn, and every strong call writes outputs of its own."""
    import torch

    from lamport_mhc import SimulatedGroup
    from lamport_mhc.bench.local_forms import FormForcer

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import local_forms
    finally:
        sys.path.remove(str(SCRIPT.parent))
    kernels = SimulatedGroup(1, hidden_size=256, hc_mult=4, max_num_tokens=8, top_k=6).paths[0].kernels["triton"]
    seen = {"fused": [], "strong": [], "outputs": []}

    def op(x, *consumer, mxfp8_out=None):
        if kernels.on_launch is not None:  # inside kernel_launched
            kernels.on_launch("local_quant", x.shape[0])
        seen["fused"].append(x.data_ptr())
        return (x,)

    class Tail:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, reduced, *args):
            seen["strong"].append(reduced.data_ptr())
            seen["outputs"].append(args[6])  # residual_out, after the consumer's six; kept alive

    monkeypatch.setattr(local_forms, "StrongTail", Tail)
    # The graph timer's stand-in: a path's four calls when it is added.
    monkeypatch.setattr(local_forms, "GraphTimer", lambda calls, replays: StandInTimer(calls, replays, 4))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"L2_cache_size": 1})())
    row = local_forms.measure_row(op, FormForcer(kernels), 256, "quant", 3, ["auto"], ["looped"],
                                  torch.device("cpu"), cold=True)
    first, second = seen["fused"][:2]
    assert row["copies"] == 2 and row["same_bits"] and first != second
    assert seen["fused"] == [first, second] * 2 + [first]  # the call kernel_launched made, then 4 timed
    assert seen["strong"] == [second, first] * 2
    assert len({output.data_ptr() for output in seen["outputs"]}) == 4
