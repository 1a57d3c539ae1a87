"""The benchmark's graph timer with stand-ins for the CUDA calls it makes, so its bookkeeping is
checked on every CPU run (on a GPU, with real graphs: ``tests/gpu/test_bench_timer.py``)."""

import contextlib
import gc
import weakref

import pytest
import torch

from lamport_mhc.bench.timing import GraphTimer


class _Stream:
    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def gpu_log(monkeypatch) -> list:
    """Stand-ins for the CUDA calls; what reached the stand-in GPU, in order: ``("replay", graph)``
    and ``("event", event)``."""
    log: list = []

    class Graph:
        def replay(self) -> None:
            log.append(("replay", self))

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            pass

        def record(self) -> None:
            log.append(("event", self))

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return 1.0  # ms

    for name, stand_in in (("Stream", _Stream), ("current_stream", _Stream), ("synchronize", lambda: None),
                           ("stream", lambda stream: contextlib.nullcontext()), ("CUDAGraph", Graph),
                           ("graph", lambda graph: contextlib.nullcontext()), ("Event", Event)):
        monkeypatch.setattr(torch.cuda, name, stand_in)
    return log


def test_a_captured_paths_buffers_outlive_its_add(gpu_log):
    """A path's buffers may be held by its callable alone (the sweep's strong tail writes into
    buffers made for the row), and the next capture's ``empty_cache`` would give them back to the
    driver while the graph still writes them."""
    timer = GraphTimer(calls=2, replays=1)
    out = torch.zeros(4)
    held = weakref.ref(out)
    assert timer.add(lambda out=out: out.add_(1)) == []
    del out
    timer.add(lambda: None)
    gc.collect()
    assert held() is not None, "a captured path's buffer died before its graph's replay"
    assert held()[0].item() == 3 + 2  # three calls outside the graph, then the captured ones


def test_every_timed_replay_follows_an_untimed_one_of_its_own_graph(gpu_log):
    calls, replays = 4, 3
    timer = GraphTimer(calls, replays)
    paths = [timer.add(lambda: None) for _ in range(3)]
    assert gpu_log == [] and all(samples == [] for samples in paths)  # filled by replay
    timer.replay()
    replays_of = [entry[1] for entry in gpu_log if entry[0] == "replay"]
    order = list(dict.fromkeys(replays_of))
    assert len(order) == 3 and replays_of == [g for _ in range(replays) for g in order for _ in range(2)]
    # A graph's untimed replay, then the start event, its timed replay and the end event.
    assert "".join(entry[0][0] for entry in gpu_log) == "rere" * 3 * replays
    assert all(samples == [1e3 / calls] * replays for samples in paths)
    timer.replay()  # the graphs were freed: nothing more is replayed
    assert sum(entry[0] == "replay" for entry in gpu_log) == 2 * 3 * replays
