"""Timing inside CUDA graphs: ``calls`` calls per graph, one sample per replay, max over ranks.

``GraphTimer`` times the paths of one row together: it captures their graphs one after another,
then replays them in turns, every graph once a turn. Each path's samples then come from the same
seconds as every other's, so a drift of clocks or temperature over the row falls on all of them
alike, where timing the paths one after another would put it between them."""

from __future__ import annotations


class GraphTimer:
    """``add`` captures a path's graph and gives the list its samples will go to; ``replay`` fills
    every list: one untimed turn (a graph's first replay runs slow), then ``replays`` timed turns."""

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
        events = [[] for _ in self._graphs]
        for turn in range(self.replays + 1):
            for (graph, _, _), spans in zip(self._graphs, events):
                if grouped:  # every rank's replay starts together
                    dist.barrier()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                if turn:
                    spans.append(start.elapsed_time(end) * 1e3 / self.calls)
        us = torch.tensor(events, dtype=torch.float64, device="cuda")
        if grouped:
            dist.all_reduce(us, op=dist.ReduceOp.MAX)
        for (_, samples, _), row in zip(self._graphs, us.tolist()):
            samples.extend(row)
        self._graphs.clear()


def time_graph(fn, calls: int, replays: int, after_capture=None) -> list[float]:
    """One path alone (``GraphTimer``): its per-replay microseconds per call, max over ranks."""
    timer = GraphTimer(calls, replays)
    samples = timer.add(fn, after_capture)
    timer.replay()
    return samples
