"""One GPU, about a minute: the strong unfused kernels alone (``lamport_mhc.bench.strong_tail``),
every form of the tail (``strong_tail.STRATEGIES``), their error against the CPU reference and
their bandwidth against the device-copy ceiling.

    python bench/check_strong_tail.py [--hidden 4096 5120 7168] [--num-warps 4]

(``--interpret`` runs it on the CPU under the Triton interpreter, timing one call: a check of the
script, not of the speed.)

Exits 1 when the faster form stays under 85% of the device copy at some M >= 1024 (it is then no
fair baseline) or an output is off by more than bf16-level error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lamport_mhc import reference  # noqa: E402
from lamport_mhc.bench.floors import tail_bytes  # noqa: E402
from lamport_mhc.bench.strong_tail import STRATEGIES, StrongFinalize, StrongTail  # noqa: E402
from lamport_mhc.bench.timing import time_graph  # noqa: E402
from lamport_mhc.mxfp8 import mxfp8_quantize_reference, mxfp8_scale_bytes  # noqa: E402
from lamport_mhc.testing import permuted_routes  # noqa: E402

BAR, FROM_M, HC, TOP_K = 0.85, 1024, 4, 6


def graph_us(fn, calls=50, replays=5, interpret=False) -> float:
    if interpret:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return statistics.median(time_graph(fn, calls, replays))


def relative_error(actual, expected) -> float:
    """Largest error against the value or the row's RMS (a collapse can cancel to near zero)."""
    a, e = actual.cpu().float().flatten(1), expected.float().flatten(1)
    return ((a - e).abs() / (e.abs() + e.pow(2).mean(-1, keepdim=True).sqrt())).max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 1024, 4096, 8192])
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter (checks the script)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.interpret else "cuda")
    nbytes = 1 << (20 if args.interpret else 28)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ceiling = 2 * nbytes / graph_us(lambda: dst.copy_(src), 5, 5, args.interpret) / 1e3
    print(f"device copy {ceiling:.0f} GB/s; bar: {BAR:.0%} of it from M = {FROM_M}")
    failures = []
    for hidden in args.hidden:
        for variant in ("plain", "quant", "finalize"):
            tails = {form: StrongTail(hidden, HC, quantize=variant == "quant", num_warps=args.num_warps,
                                      strategy=form, interpret=args.interpret) for form in STRATEGIES}
            finalize = StrongFinalize(hidden, TOP_K, interpret=args.interpret)
            cells = []
            for m in args.rows:
                g = torch.Generator(device=device).manual_seed(m)
                x = torch.randn(m, hidden, device=device, generator=g).bfloat16()
                residual = torch.randn(m, HC, hidden, device=device, generator=g).bfloat16()
                post = torch.rand(m, HC, device=device, generator=g) * 2
                comb = torch.rand(m, HC, HC, device=device, generator=g)
                pre = torch.rand(m, HC, device=device, generator=g)
                weight = torch.randn(hidden, device=device, generator=g).bfloat16()
                residual_out = torch.empty_like(residual)
                layer_input, contribution = torch.empty_like(x), torch.empty_like(x)
                mxfp8 = None
                if variant == "quant":
                    mxfp8 = (torch.empty(m, hidden, dtype=torch.float8_e4m3fn, device=device),
                             torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device))
                held = 0
                if variant == "finalize":
                    indices = permuted_routes(m, TOP_K, g, device)  # a row per held route, as engines lay them out
                    held = int((indices >= 0).sum())
                    gemm2 = torch.randn(max(1, held), hidden, device=device, generator=g).bfloat16()
                    weights = torch.rand(m, TOP_K, device=device, generator=g)

                def call(tail):
                    reduced = finalize(gemm2, weights, indices, x, contribution) if variant == "finalize" else x
                    tail(reduced, residual, post, comb, pre, weight, 1e-6, residual_out, layer_input, mxfp8)

                times = {}
                for form, tail in tails.items():
                    call(tail)
                    if not args.interpret:
                        torch.cuda.synchronize()
                    if m == args.rows[0] or m == 128:
                        failures += check(variant, hidden, m, form, x, residual, post, comb, pre, weight,
                                          residual_out, layer_input, mxfp8,
                                          (gemm2, weights, indices) if variant == "finalize" else None)
                    times[form] = graph_us(lambda t=tail: call(t), interpret=args.interpret)
                form = min(times, key=times.get)
                fraction = tail_bytes(variant, m, hidden, HC, held, TOP_K) / times[form] / 1e3 / ceiling
                cells.append(f"M={m} {'/'.join(f'{times[f]:.1f}' for f in STRATEGIES)} us, {form} {fraction:.0%}")
                if m >= FROM_M and fraction < BAR:
                    failures.append(f"H={hidden} {variant} M={m}: {fraction:.0%} of the device copy")
            print(f"H={hidden} {variant:8s} " + "  ".join(cells), flush=True)
    for failure in failures:
        print("FAIL " + failure)
    print("strong tail: " + ("meets the bar" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


def check(variant, hidden, m, form, x, residual, post, comb, pre, weight, residual_out, layer_input, mxfp8,
          routes) -> list[str]:
    """The outputs against the reference (the MXFP8 copy against its own layer input, exactly)."""
    if routes is None:
        reduced = x.cpu()
    else:
        gemm2, weights, indices = routes
        reduced = reference.finalize_contribution(gemm2.cpu(), weights.cpu(), indices.cpu(), x.cpu())
    ref_residual, ref_layer, _ = reference.all_reduce_mhc(
        [reduced], residual.cpu(), post.cpu(), comb.cpu(), pre.cpu(), weight.cpu(), 1e-6)
    error = max(relative_error(residual_out, ref_residual), relative_error(layer_input, ref_layer))
    exact = True
    if mxfp8 is not None:
        values, scales = mxfp8_quantize_reference(layer_input.cpu())
        exact = (torch.equal(values.view(torch.uint8), mxfp8[0].cpu().view(torch.uint8))
                 and torch.equal(scales, mxfp8[1].cpu()))
    if error > 2 ** -5 or not exact:
        return [f"H={hidden} {variant} M={m} {form}: error {error:.2e}, MXFP8 of its own output "
                f"{'exact' if exact else 'NOT exact'}"]
    return []


if __name__ == "__main__":
    sys.exit(main())
