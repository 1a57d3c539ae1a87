"""The benchmark's graph timer on a GPU: a row's graphs are replayed in turns, each timed replay after
an untimed one of the same graph, each graph's samples are its own, and what a graph's calls hold
lives until the graph is freed."""

import weakref

import torch

from lamport_mhc.bench.timing import GraphTimer, time_graph

from .harness import require_gpus


def test_graph_timer_replays_every_graph_in_turns():
    require_gpus(1)
    calls, replays = 4, 5
    timer = GraphTimer(calls, replays)
    counter = torch.zeros(1, device="cuda")
    short = timer.add(lambda: counter.add_(1))
    long = timer.add(lambda: torch.cuda._sleep(1_000_000))  # about 0.5 ms a call
    assert short == [] and long == []  # filled by replay
    timer.replay()
    assert len(short) == len(long) == replays
    assert min(long) > 10 * max(short)
    # Three calls outside the graph, then calls per replay over each turn's untimed and timed replays.
    assert counter.item() == 3 + calls * 2 * replays
    timer.replay()  # the graphs were freed: nothing more is timed
    assert len(short) == replays
    assert len(time_graph(lambda: counter.add_(1), calls, replays)) == replays


def test_graph_timer_keeps_what_a_graph_writes_until_it_is_freed():
    """A path's buffers may be held by its callable alone (the sweep's strong tail writes into
    buffers made for the row): they must outlive the next capture, whose ``empty_cache`` would give
    a dead closure's memory back to the driver, until the replay."""
    require_gpus(1)
    timer = GraphTimer(2, 1)
    out = torch.zeros(1 << 22, device="cuda")  # 16 MiB: a segment of its own
    held = weakref.ref(out)
    samples = timer.add(lambda out=out: out.add_(1))
    del out
    other = torch.zeros(1, device="cuda")
    timer.add(lambda: other.add_(1))  # its capture empties the allocator's cache
    assert held() is not None, "a captured graph's buffer died before its replay"
    kept = held()
    timer.replay()
    assert len(samples) == 1 and kept[0].item() == 3 + 2 * 2  # warm-up calls, then the untimed and timed replays
    del kept
    assert held() is None, "the timer held a graph's buffer past its replay"
