import statistics, sys, time
import torch
from lamport_mhc import reference
from lamport_mhc.mxfp8 import mxfp8_quantize_reference, mxfp8_scale_bytes
from lamport_mhc.bench.strong_tail import StrongTail, StrongFinalize
from lamport_mhc.bench.floors import tail_bytes

def graph_us(fn, calls=50, replays=5):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    out = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); out.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(out)

dev = torch.device("cuda")
n = 1 << 28
src = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).normal_(); dst = torch.empty_like(src)
hbm = 2 * n / graph_us(lambda: dst.copy_(src), 5, 5) / 1e3
print(f"device copy {hbm:.0f} GB/s", flush=True)
warps = [int(w) for w in sys.argv[1:]] or [8]
hc = 4
for H in (4096, 5120, 7168):
    for quant in (False, True):
        for nw in warps:
            tail = StrongTail(H, hc, quantize=quant, num_warps=nw)
            line = []
            for m in (1, 16, 128, 1024, 4096, 8192):
                g = torch.Generator(device=dev).manual_seed(m)
                red = torch.randn(m, H, device=dev).bfloat16(); res = torch.randn(m, hc, H, device=dev).bfloat16()
                post = torch.rand(m, hc, device=dev) * 2; comb = torch.rand(m, hc, hc, device=dev); pre = torch.rand(m, hc, device=dev)
                w = torch.randn(H, device=dev).bfloat16()
                ro = torch.empty_like(res); li = torch.empty_like(red)
                mx = (torch.empty(m, H, dtype=torch.float8_e4m3fn, device=dev), torch.empty(mxfp8_scale_bytes(m, H), dtype=torch.uint8, device=dev)) if quant else None
                call = lambda: tail(red, res, post, comb, pre, w, 1e-6, ro, li, mx)
                call(); torch.cuda.synchronize()
                if m == 128:
                    rro, rli, rmx = reference.all_reduce_mhc([red.cpu()], res.cpu(), post.cpu(), comb.cpu(), pre.cpu(), w.cpu(), 1e-6, quantize=quant)
                    d1 = ((ro.cpu().float() - rro.float()).abs() / rro.float().abs().clamp(min=1e-20)).max().item()
                    rms = rli.float().pow(2).mean(-1, keepdim=True).sqrt()
                    d2 = ((li.cpu().float() - rli.float()).abs() / (rli.float().abs() + rms)).max().item()
                    ok = ""
                    if quant:
                        qv, qs = mxfp8_quantize_reference(li.cpu())
                        ok = f" mx exact {torch.equal(qv.view(torch.uint8), mx[0].cpu().view(torch.uint8)) and torch.equal(qs, mx[1].cpu())}"
                    print(f"  check H={H} quant={quant}: ro rel {d1:.2e} li rel {d2:.2e}{ok}", flush=True)
                us = graph_us(call)
                frac = tail_bytes("quant" if quant else "plain", m, H, hc) / us / 1e3 / hbm
                line.append(f"M={m}:{us:.1f}us/{frac:.0%}")
            print(f"H={H} quant={quant} warps={nw}: " + " ".join(line), flush=True)
    fin = StrongFinalize(H, 6)
    line = []
    for m in (1, 128, 1024, 4096, 8192):
        rows = m * 3
        gm = torch.randn(rows, H, device=dev).bfloat16(); wt = torch.rand(m, 6, device=dev)
        idx = torch.randint(0, rows, (m, 6), device=dev, dtype=torch.int32); idx[torch.rand(m, 6, device=dev) < 0.33] = -1
        sh = torch.randn(m, H, device=dev).bfloat16(); out = torch.empty_like(sh)
        fin(gm, wt, idx, sh, out); torch.cuda.synchronize()
        if m == 128:
            ref = reference.finalize_contribution(gm.cpu(), wt.cpu(), idx.cpu(), sh.cpu())
            print(f"  check finalize H={H}: rel {((out.cpu().float()-ref.float()).abs()/(ref.float().abs()+1e-2)).max().item():.2e}")
        us = graph_us(lambda: fin(gm, wt, idx, sh, out))
        held = int((idx >= 0).sum())
        nbytes = held * H * 2 + 2 * m * H * 2 + m * 6 * 8
        line.append(f"M={m}:{us:.1f}us/{nbytes/us/1e3/hbm:.0%}")
    print(f"finalize H={H}: " + " ".join(line), flush=True)
