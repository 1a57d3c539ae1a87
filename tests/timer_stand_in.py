"""A stand-in for the benchmark's ``GraphTimer`` on CPU: each path is called when it is added (no
graph; ``calls_at_add`` times, once by default), and its samples, filled at ``replay``, are its place
in the order added, so a path added later looks slower."""


class StandInTimer:
    added: list = []  # every path added, by every timer of the process, in order

    def __init__(self, calls: int, replays: int, calls_at_add: int = 1):
        self.replays, self.calls_at_add = replays, calls_at_add
        self.pending: list = []

    def add(self, fn, after_capture=None) -> list[float]:
        for _ in range(self.calls_at_add):
            fn()
        if after_capture is not None:
            after_capture()
        StandInTimer.added.append(fn)
        samples: list[float] = []
        self.pending.append((samples, float(len(StandInTimer.added))))
        return samples

    def replay(self) -> None:
        for samples, place in self.pending:
            samples.extend([place] * self.replays)
        self.pending.clear()
