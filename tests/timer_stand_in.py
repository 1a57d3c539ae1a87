"""A stand-in for the benchmark's ``GraphTimer`` on CPU ranks: each path is called once when it is
added (no graph), and its samples, filled at ``replay``, are its place in the order added, so a path
added later looks slower."""


class CallOnceTimer:
    added: list = []  # every path added, by every timer of the process, in order

    def __init__(self, calls: int, replays: int):
        self.replays = replays
        self.pending: list = []

    def add(self, fn, after_capture=None) -> list[float]:
        fn()
        if after_capture is not None:
            after_capture()
        CallOnceTimer.added.append(fn)
        samples: list[float] = []
        self.pending.append((samples, float(len(CallOnceTimer.added))))
        return samples

    def replay(self) -> None:
        for samples, place in self.pending:
            samples.extend([place] * self.replays)
        self.pending.clear()
