"""Run a command as a user types it: in a process session of its own, under a timeout, with the
peak resident memory of its whole process tree sampled while it runs.

A hung Lamport protocol is a hang, not an error, and torchrun's workers outlive a killed torchrun:
on timeout the whole session is killed. The peak is the largest sum of the tree's resident set
sizes seen at any sample (every ``SAMPLE_S``), and the largest single process beside it.

``python tests/gpu/commands.py TIMEOUT_S -- ARGV...`` runs one command and prints what it measured.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

SAMPLE_S = 0.1
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class CommandRun:
    argv: list[str]
    returncode: int | None        # None: killed at the timeout
    output: str                   # stdout and stderr together
    seconds: float
    peak_tree_bytes: int          # the largest sum over the process tree at one sample
    peak_process_bytes: int       # the largest single process

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        status = "timed out" if self.timed_out else f"exit {self.returncode}"
        return (f"{' '.join(self.argv)}: {status} in {self.seconds:.1f} s, peak RSS {self.peak_tree_bytes / 2**30:.2f} "
                f"GiB (largest process {self.peak_process_bytes / 2**30:.2f} GiB)")


def _session_rss(session: int) -> tuple[int, int]:
    """(sum, max) of the resident bytes of every process in ``session``."""
    total = largest = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # fields after the name: state, ppid, pgrp, session, ...
                continue
            with open(f"/proc/{name}/statm") as f:
                resident = int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue  # the process ended between the listing and the read
        total += resident
        largest = max(largest, resident)
    return total, largest


def run_command(argv: list[str], timeout_s: float, *, env: dict | None = None, cwd=None) -> CommandRun:
    """Run ``argv`` to its end or ``timeout_s``; kill its whole process session on timeout."""
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env, cwd=cwd)
    peaks = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total, largest = _session_rss(process.pid)
            peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], largest)
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        output, _ = process.communicate(timeout=timeout_s)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        returncode = None
    finally:
        done.set()
        sampler.join()
    try:  # workers a finished torchrun left behind
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return CommandRun(list(argv), returncode, output, time.monotonic() - started, peaks[0], peaks[1])


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python tests/gpu/commands.py TIMEOUT_S -- ARGV...")
    run = run_command(sys.argv[3:], float(sys.argv[1]))
    print(run.output, end="")
    print(run.describe())
    sys.exit(124 if run.timed_out else run.returncode)
