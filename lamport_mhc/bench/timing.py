"""Timing inside CUDA graphs: ``calls`` calls per graph, one sample per replay, max over ranks.

``GraphTimer`` times the paths of one row together: it captures their graphs one after another,
then replays them in turns, every graph once a turn. Each path's samples then come from the same
seconds as every other's, so a drift of clocks or temperature over the row falls on all of them
alike, where timing the paths one after another would put it between them.

Each timed replay follows an untimed replay of the same graph, so a path's timed calls start from
what its own calls leave behind (in the L2 above all), not from what the graph before it left.

What runs in the same turns can still weigh on a path. On one H100 (tp = 1, rows of about the L2's
size of bytes) the unfused paths' compiled torch tails, replayed among the others, slowed the fused
paths by up to 20% (H 4096 quant M = 256: 6.2 against 5.2 us without them) even after this untimed
replay, and the strong tail not at all (an uncompiled tail slowed H 4096 quant M = 256 too); the
sweep gives them turns of their own (``Sweep``)."""

from __future__ import annotations


class GraphTimer:
    """``add`` captures a path's graph and gives the list its samples will go to; ``replay`` fills
    every list: ``replays`` turns, each graph's timed replay after an untimed one of its own (which
    also takes a graph's first replay, which runs slow)."""

    def __init__(self, calls: int, replays: int):
        self.calls, self.replays = calls, replays
        # (graph, samples, fn): a graph reads and writes the tensors its calls captured, which only
        # ``fn``'s closure may hold (a path's output buffers); ``fn`` lives as long as its graph, or
        # the next capture's ``empty_cache`` could hand those buffers back to the driver.
        self._graphs: list = []

    def add(self, fn, after_capture=None) -> list[float]:
        """Capture ``calls`` calls of ``fn`` (after three outside the graph, which build and load
        what they use). ``after_capture`` runs on every rank before the first replay (vLLM's custom
        all-reduce registers the buffers the graph captured there). Returns the (empty) list of
        per-replay microseconds per call, each the max over ranks, that ``replay`` fills."""
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.calls):
                fn()
        if after_capture is not None:
            after_capture()
        samples: list[float] = []
        self._graphs.append((graph, samples, fn))
        return samples

    def replay(self) -> None:
        """Replay every graph captured since the last ``replay``, in turns, then free them (and
        what their calls held)."""
        import torch
        import torch.distributed as dist

        if not self._graphs:
            return
        grouped = dist.is_available() and dist.is_initialized()
        spans = [[] for _ in self._graphs]
        for _ in range(self.replays):
            for (graph, _, _), path_spans in zip(self._graphs, spans):
                _start_together(grouped)
                graph.replay()  # untimed: the path's own bytes into L2 (see the module's docstring)
                _start_together(grouped)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                path_spans.append(start.elapsed_time(end) * 1e3 / self.calls)
        if grouped:
            us = torch.tensor(spans, dtype=torch.float64, device="cuda")
            dist.all_reduce(us, op=dist.ReduceOp.MAX)
            spans = us.tolist()
        for (_, samples, _), path_spans in zip(self._graphs, spans):
            samples.extend(path_spans)
        self._graphs.clear()


def _start_together(grouped: bool) -> None:
    """The GPU idle, and with a group every rank here, before a replay."""
    import torch
    import torch.distributed as dist

    if grouped:
        dist.barrier()
    torch.cuda.synchronize()


def time_graph(fn, calls: int, replays: int, after_capture=None) -> list[float]:
    """One path alone (``GraphTimer``): its per-replay microseconds per call, max over ranks."""
    timer = GraphTimer(calls, replays)
    samples = timer.add(fn, after_capture)
    timer.replay()
    return samples
