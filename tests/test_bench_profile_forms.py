"""bench/profile_forms.py's command line, on the CPU: the rows and forms it accepts and the ones it
refuses before it touches a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_forms.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (("--rows", "5120:finalize:100"), "variant must be plain or quant"),
    (("--rows", "5120:quant:100", "--fused", "auto,roomy"), "fused forms are auto or"),
    (("--rows", "5120:quant:100", "--strong", "looped,fastest"), "strong forms are"),
])
def test_bad_rows_and_forms_are_refused(args, message):
    result = _run(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_every_form_the_forcer_has_is_accepted_hinted_or_not():
    from lamport_mhc.bench.local_forms import FORMS
    from lamport_mhc.bench.strong_tail import STRATEGIES

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import profile_forms
    finally:
        sys.path.remove(str(SCRIPT.parent))
    forms = ",".join(["auto", *FORMS, *(f"{form}-hinted" for form in FORMS)])
    assert profile_forms.parse_fused(forms) == forms.split(",")
    assert profile_forms.parse_strong(",".join(STRATEGIES)) == list(STRATEGIES)
    assert profile_forms.parse_row("7168:plain:128") == (7168, "plain", 128)
