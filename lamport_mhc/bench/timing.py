"""Timing inside CUDA graphs: ``calls`` calls per graph, one sample per replay, max over ranks."""

from __future__ import annotations


def time_graph(fn, calls: int, replays: int, after_capture=None) -> list[float]:
    """Per-replay microseconds per call, each the max over ranks (one process without a group: its
    own). ``after_capture`` runs on every rank between capture and the first replay (vLLM's custom
    all-reduce registers the buffers the graph captured there)."""
    import torch
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    if after_capture is not None:
        after_capture()
    grouped = dist.is_available() and dist.is_initialized()
    samples = []
    for _ in range(replays):
        if grouped:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        us = torch.tensor(start.elapsed_time(end) * 1e3 / calls, device="cuda")
        if grouped:
            dist.all_reduce(us, op=dist.ReduceOp.MAX)
        samples.append(us.item())
    del graph
    return samples
