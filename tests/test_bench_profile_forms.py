"""The command lines of bench/profile_forms.py and bench/local_forms.py, on the CPU: the rows and
forms they accept and the ones they refuse before they touch a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest

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
