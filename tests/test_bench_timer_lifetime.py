"""The graph timer keeps what a captured path holds alive until its graph is freed (on a GPU, where
it replays: ``tests/gpu/test_bench_timer.py``). Here the CUDA calls it makes are stand-ins, so
the check runs on every CPU run: a path's buffers may be held by its callable alone, and the next
capture's ``empty_cache`` would give them back to the driver while the graph still writes them."""

import contextlib
import gc
import weakref

import torch

from lamport_mhc.bench.timing import GraphTimer


class _Stream:
    def wait_stream(self, other) -> None:
        pass


def test_a_captured_paths_buffers_outlive_its_add(monkeypatch):
    for name, stand_in in (("Stream", _Stream), ("current_stream", _Stream), ("synchronize", lambda: None),
                           ("stream", lambda stream: contextlib.nullcontext()), ("CUDAGraph", object),
                           ("graph", lambda graph: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, stand_in)
    timer = GraphTimer(calls=2, replays=1)
    out = torch.zeros(4)
    held = weakref.ref(out)
    assert timer.add(lambda out=out: out.add_(1)) == []
    del out
    timer.add(lambda: None)
    gc.collect()
    assert held() is not None, "a captured path's buffer died before its graph's replay"
    assert held()[0].item() == 3 + 2  # three calls outside the graph, then the captured ones
