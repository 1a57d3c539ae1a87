"""Run a command as a user types it: under a timeout, with the
peak resident memory of its whole process tree sampled while it runs.

A hung Lamport protocol is a hang, not an error, and torchrun's workers (in sessions of their own)
outlive a killed torchrun: on timeout the whole process tree is killed. The peak is the largest sum
of the tree's resident set sizes seen at any sample (every ``SAMPLE_S``), and the largest single
process beside it.

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


def _processes() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, resident bytes)} of every process now."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])  # after the name: state, ppid, ...
            with open(f"/proc/{name}/statm") as f:
                resident = int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue  # the process ended between the listing and the read
        found[int(name)] = (parent, resident)
    return found


def _tree(root: int, processes: dict[int, tuple[int, int]]) -> list[int]:
    """``root`` and its descendants (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in processes:
            tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _kill_tree(root: int) -> None:
    for pid in _tree(root, _processes()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_command(argv: list[str], timeout_s: float, *, env: dict | None = None, cwd=None) -> CommandRun:
    """Run ``argv`` to its end or ``timeout_s``; kill its whole process session on timeout."""
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    peaks = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            processes = _processes()
            sizes = [processes[pid][1] for pid in _tree(process.pid, processes)]
            peaks[0], peaks[1] = max(peaks[0], sum(sizes)), max([peaks[1], *sizes])
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        output, _ = process.communicate(timeout=timeout_s)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(process.pid)
        output, _ = process.communicate()
        returncode = None
    finally:
        done.set()
        sampler.join()
    return CommandRun(list(argv), returncode, output, time.monotonic() - started, peaks[0], peaks[1])


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python tests/gpu/commands.py TIMEOUT_S -- ARGV...")
    run = run_command(sys.argv[3:], float(sys.argv[1]))
    print(run.output, end="")
    print(run.describe())
    sys.exit(124 if run.timed_out else run.returncode)
