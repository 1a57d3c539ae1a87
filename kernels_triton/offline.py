"""Compile a build's kernels to PTX without a GPU (Triton compiles offline for any target)."""

from __future__ import annotations

from lamport_mhc.backend import BuildSpec

from .plan import kernel_plan


def parse_arch(arch: str) -> int:
    """"sm_90a" / "sm_90" / "90" -> 90; Triton emits the arch-specific target (sm_90a) itself."""
    digits = arch.lower().removeprefix("sm_").rstrip("af")
    if not digits.isdigit() or int(digits) < 90:
        raise ValueError(f"arch must be sm_90a or newer (e.g. sm_90a, sm_100a), got {arch!r}")
    return int(digits)


def compile_ptx(spec: BuildSpec, arch: str = "sm_90a") -> dict[str, str]:
    """PTX of every kernel of the build, keyed by the plan's names."""
    return {name: compile_kernel(instance.fn, instance.signature, instance.constexprs, instance.options, arch,
                                 launch_pdl=spec.use_pdl)
            for name, instance in kernel_plan(spec, on_gpu=True).items()}


def compile_kernel(fn, signature: dict, constexprs: dict, options: dict, arch: str = "sm_90a",
                   launch_pdl: bool = True) -> str:
    """PTX of one Triton kernel: ``signature`` its runtime arguments' types, every pointer taken as
    16-byte aligned but those the kernel is not specialized on (what the launcher's specialization
    sees at run time)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", parse_arch(arch), 32)
    full_signature = dict(signature)
    full_signature.update({key: "constexpr" for key in constexprs})
    unaligned = set(getattr(fn, "do_not_specialize_on_alignment", ()))
    aligned = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]]
               for arg, kind in signature.items() if kind.startswith("*") and arg not in unaligned}
    source = ASTSource(fn=fn, signature=full_signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=target, options={**options, "launch_pdl": launch_pdl}).asm["ptx"]
