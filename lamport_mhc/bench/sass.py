"""What the GPU would run, read without one: a kernel's PTX assembled by ptxas into SASS, its
resources (registers, spills) and the instructions of each loop body.

At few rows per SM the consumers are issue-bound, so instructions a chunk are time there; this is
how a change's instructions are counted before a GPU measures it. The tools are the CUDA binaries
that Triton's wheel ships (``triton/backends/nvidia/bin``), so any machine that installs the CPU
tiers has them. ``python -m lamport_mhc ptx ... --sass`` writes a ``.sass`` beside each ``.ptx``
and prints this summary.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def cuda_tool(name: str) -> Path:
    """One of the CUDA binaries Triton ships (ptxas, nvdisasm, cuobjdump)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not in this Triton install ({path.parent})")
    return path


@dataclass(frozen=True)
class SassSummary:
    registers: int
    stack_bytes: int    # spills and local arrays
    instructions: int   # in the whole kernel, NOPs left out
    loops: tuple[int, ...]  # instructions of each loop body, in the kernel's order

    def line(self) -> str:
        return (f"{self.registers} registers, {self.stack_bytes} stack bytes, {self.instructions} instructions, "
                f"loop bodies {list(self.loops)}")


def assemble(ptx: str, arch: str = "sm_90a") -> bytes:
    """The cubin ptxas makes of ``ptx`` for ``arch``."""
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        source.write_text(ptx)
        subprocess.run([str(cuda_tool("ptxas")), f"-arch={arch}", str(source), "-o", str(cubin)], check=True,
                       capture_output=True, text=True)
        return cubin.read_bytes()


def disassemble(cubin: bytes) -> tuple[str, SassSummary]:
    """The SASS of a one-kernel cubin and its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([str(cuda_tool("nvdisasm")), "-c", str(path)], check=True, capture_output=True,
                              text=True).stdout
        usage = subprocess.run([str(cuda_tool("cuobjdump")), "--dump-resource-usage", str(path)], check=True,
                               capture_output=True, text=True).stdout
    found = _RESOURCES.search(usage)
    if found is None:
        raise RuntimeError(f"cuobjdump reported no resource usage:\n{usage}")
    instructions, loops = count_instructions(sass)
    return sass, SassSummary(int(found.group(1)), int(found.group(2)), instructions, loops)


def count_instructions(sass: str) -> tuple[int, tuple[int, ...]]:
    """(instructions, the instructions of each loop body) of nvdisasm's text, NOPs left out: a loop
    body runs from a label to the branch back to it."""
    body, labels, loops = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(body)
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None or instruction.group(1).split()[0] == "NOP":
            continue
        body.append(instruction.group(1))
        target = _BRANCH_TARGET.search(instruction.group(1))
        if target and target.group(1) in labels and len(body) - labels[target.group(1)] > 1:  # not a spin on itself
            loops.append(len(body) - labels[target.group(1)])
    return len(body), tuple(loops)
