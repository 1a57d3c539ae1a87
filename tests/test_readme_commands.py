"""The GPU tier's command list (tests/gpu/test_commands.py) and the README stay in step: every command
the README shows a user runs there, and every entry there is a command the README shows."""

import re
from pathlib import Path

from gpu.test_commands import README_COMMANDS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _subcommand(text: str) -> str | None:
    """``demo`` of ``torchrun ... -m lamport_mhc demo``; a module's name for ``-m lamport_mhc.x.y``."""
    found = re.search(r"-m lamport_mhc(\.[\w.]+)?(?: (\w[\w-]*))?", text)
    if found is None:
        return None
    return found.group(1)[1:] if found.group(1) else found.group(2)


def test_every_entry_is_a_command_the_readme_shows():
    readme = _flat(README)
    missing = [text for text, *_ in README_COMMANDS if f"`{_flat(text)}`" not in readme]
    assert not missing, missing


def test_every_command_the_readme_shows_runs_in_the_gpu_tier():
    shown = {_subcommand(_flat(span)) for span in re.findall(r"`([^`]+)`", README)} - {None}
    covered = {_subcommand(" ".join(argv)) for _, argv, *_ in README_COMMANDS}
    assert shown, "no command found in the README"
    assert shown <= covered, f"README commands with no run in tests/gpu/test_commands.py: {sorted(shown - covered)}"
