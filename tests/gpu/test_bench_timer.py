"""The benchmark's graph timer on a GPU: a row's graphs are replayed in turns, each once a turn after
an untimed first turn, and each graph's samples are its own."""

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
    # Three calls outside the graph, then calls per replay over the untimed turn and the timed ones.
    assert counter.item() == 3 + calls * (replays + 1)
    timer.replay()  # the graphs were freed: nothing more is timed
    assert len(short) == replays
    assert len(time_graph(lambda: counter.add_(1), calls, replays)) == replays
