"""Compile a build's CuTe DSL kernels to PTX without a GPU: fake tensors stand in for the buffers,
the target comes from the compile options (not the machine), and the PTX is read back from the
artifact the compiler keeps. ptxas also runs, so an invalid instruction fails here, not on the GPU,
and the cubin it writes tells each kernel's registers and stack (spills) per thread."""

from __future__ import annotations

import glob
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from lamport_mhc.backend import BuildSpec

MIN_SM = 90  # griddepcontrol (PDL) and multimem.st


def parse_arch(arch: str) -> str:
    """"sm_90a" / "sm_90" / "90" -> "sm_90a"; "sm_100a" -> "sm_100a". The kernels target the
    architecture-specific variant of sm_90 or newer."""
    digits = arch.lower().removeprefix("sm_").rstrip("af")
    if not digits.isdigit() or int(digits) < MIN_SM:
        raise ValueError(f"arch must be sm_90a or newer (e.g. sm_90a, sm_100a), got {arch!r}")
    return f"sm_{int(digits)}a"


# kind -> (element type name, assumed alignment in bytes, divisibility of the element count)
BUFFER_KINDS = {"*i16": ("Int16", 16, 8), "*fp32": ("Float32", 4, 1), "*i32": ("Int32", 4, 1),
                "*u8": ("Uint8", 16, 16)}


def fake_argument(kind: str, spec: BuildSpec):
    """A stand-in for one runtime argument of a kernel's signature (see ``plan``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if kind in BUFFER_KINDS:
        dtype, align, divisibility = BUFFER_KINDS[kind]
        return make_fake_compact_tensor(getattr(cutlass, dtype), (cute.sym_int(divisibility=divisibility),),
                                        assumed_align=align)
    if kind == "state":
        from lamport_mhc.layout import STATE_WORDS
        return make_fake_compact_tensor(Int32, (STATE_WORDS,), assumed_align=4)
    if kind == "error":
        from lamport_mhc.layout import ERROR_WORDS
        return make_fake_compact_tensor(Int32, (ERROR_WORDS,), assumed_align=4)
    if kind == "table":
        return make_fake_compact_tensor(Int64, (spec.tp,), assumed_align=8)
    if kind == "i32":
        return Int32(1)
    if kind == "i64":
        return Int64(0)
    if kind == "f32":
        return Float32(1e-6)
    if kind == "stream":
        return make_fake_stream()
    raise ValueError(f"unknown argument kind {kind!r}")


@dataclass(frozen=True)
class CompiledKernel:
    ptx: str
    registers: int    # per thread, as ptxas allocated them
    stack_bytes: int  # per-thread frame in local memory: spilled registers (0: none)


# Attributes of a cubin's .nv.info section (EIATTR_*), each [format, attribute, size, symbol, value].
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE, _EIATTR_FORMAT_SVAL = 0x2F, 0x11, 0x04


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, frame bytes) of the kernel of a one-kernel cubin (ELF64), from its .nv.info
    attributes; the frame is the local memory a thread spills to (the largest of its functions)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names_offset = sections[names_index][4]
    registers, frame = None, 0
    for name_offset, _, _, _, offset, size, *_ in sections:
        name = cubin[names_offset + name_offset:cubin.index(b"\0", names_offset + name_offset)]
        if name != b".nv.info":
            continue
        i = offset
        while i < offset + size:
            form, attribute = cubin[i], cubin[i + 1]
            if form == _EIATTR_FORMAT_SVAL:
                length, = struct.unpack_from("<H", cubin, i + 2)
                if attribute in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE):
                    value, = struct.unpack_from("<I", cubin, i + 8)
                    if attribute == _EIATTR_REGCOUNT:
                        registers = value if registers is None else max(registers, value)
                    else:
                        frame = max(frame, value)
                i += 4 + length
            else:  # no value, or a 2-byte value
                i += 4 if form == 0x03 else 2
    if registers is None:
        raise ValueError("the cubin states no register count")
    return registers, frame


def compile_kernels(spec: BuildSpec, arch: str = "sm_90a",
                    only: Callable[[str], bool] | None = None) -> dict[str, CompiledKernel]:
    """Every CuTe DSL kernel of the build (those whose name ``only`` accepts), keyed by the plan's
    names: its PTX and what ptxas made of it. Needs nvidia-cutlass-dsl (``pip install
    'lamport-mhc[cute]'``), no GPU."""
    try:
        import cuda.bindings.driver  # noqa: F401  (the kernels' stream type)
        import cutlass.cute as cute
    except ImportError as error:
        raise ImportError(f"compiling the CuTe DSL kernels needs nvidia-cutlass-dsl and cuda-python ({error}): "
                          "pip install 'lamport-mhc[cute]'") from error

    from .plan import kernel_plan

    target = parse_arch(arch)
    kernels = {}
    for name, instance in kernel_plan(spec).items():
        if only is not None and not only(name):
            continue
        args = [fake_argument(kind, spec) for _, kind in instance.signature]
        # The compiler writes the PTX and cubin it keeps into the dump directory.
        with tempfile.TemporaryDirectory(prefix="lamport_mhc_cute_") as dump:
            compiled = cute.compile(instance.kernel, *args,
                                    options=f"--gpu-arch {target} --keep-ptx --keep-cubin --dump-dir {dump}")
            text = compiled.__ptx__
            cubins = glob.glob(os.path.join(dump, "*.cubin"))
            if len(cubins) != 1:
                raise RuntimeError(f"CuTe DSL kept {len(cubins)} cubins for {name}, expected one")
            with open(cubins[0], "rb") as file:
                registers, frame = cubin_resources(file.read())
        if not text or f".target {target}" not in text:
            raise RuntimeError(f"CuTe DSL kept no {target} PTX for {name}")
        kernels[name] = CompiledKernel(text, registers, frame)
    return kernels


def compile_ptx(spec: BuildSpec, arch: str = "sm_90a") -> dict[str, str]:
    """PTX of every CuTe DSL kernel of the build, keyed by the plan's names (see ``compile_kernels``)."""
    return {name: kernel.ptx for name, kernel in compile_kernels(spec, arch).items()}
