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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", parse_arch(arch), 32)
    ptx = {}
    for name, instance in kernel_plan(spec, on_gpu=True).items():
        signature = dict(instance.signature)
        signature.update({key: "constexpr" for key in instance.constexprs})
        # What the launcher's specialization sees at run time: every buffer is 16-byte aligned.
        aligned = {(instance.fn.arg_names.index(arg),): [["tt.divisibility", 16]]
                   for arg, kind in instance.signature.items() if kind.startswith("*")}
        source = ASTSource(fn=instance.fn, signature=signature, constexprs=instance.constexprs, attrs=aligned)
        compiled = triton.compile(source, target=target, options={**instance.options, "launch_pdl": spec.use_pdl})
        ptx[name] = compiled.asm["ptx"]
    return ptx
