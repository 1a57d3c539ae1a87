"""The whole sweep on CPU ranks of a gloo group: every path built, called and recorded as on GPUs,
with the CUDA-graph timer replaced by a stand-in that calls each path once and the Triton kernels
interpreted (``auto`` runs the torch path there). It checks the plumbing, not the speed."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.harness import run_ranks  # noqa: E402
from timer_stand_in import StandInTimer  # noqa: E402

H = 256


def _sweep_body(rank, tp, out, variants, late=False):
    import torch

    from lamport_mhc.bench import Ceilings, sweep as sweep_module
    from lamport_mhc.bench.strong_tail import StrongFinalize, StrongTail

    sweep_module.GraphTimer = StandInTimer  # later paths look slower: unfused-best takes the first
    sweep_module.StrongTail = lambda *a, **k: StrongTail(*a, **k, interpret=True)
    sweep_module.StrongFinalize = lambda *a, **k: StrongFinalize(*a, **k, interpret=True)

    def no_flashinfer():
        raise ImportError("flashinfer stand-in: not installed")

    args = SimpleNamespace(paths=None, hc=4, rows=[1, 3], variants=variants, calls=50, replays=5, hidden=[H],
                           merge=None, top_k=2, backends=["triton"], compile_tail=False)
    import torch.distributed as dist

    sweep = sweep_module.Sweep(args, dist.group.WORLD, torch.device("cpu"))
    sweep.flashinfer.api_factory = no_flashinfer
    given = []  # (rows method, the timer it captured into), every timer kept alive so ids stay apart
    for name in ("_fused_rows", "_strong_rows", "_torch_tail_rows"):
        def spy(*method_args, _method=getattr(sweep, name), _name=name):
            given.append((_name, method_args[-1]))
            return _method(*method_args)
        setattr(sweep, name, spy)
    ceilings = Ceilings(None if tp == 1 else 100.0, 1000.0)
    sweep.run_hidden(H, ceilings)
    if late:  # the time budget runs out: the next hidden size stops before its first M, the one after is skipped
        sweep.deadline = 0.0
        sweep.run_hidden(2 * H, ceilings)
        sweep.run_hidden(4 * H, ceilings)
    sweep.finish(Path(out), "cpu", ceilings)
    # The unfused paths' torch tails are replayed in turns of their own, never among the others' (timing's
    # docstring), and every timer was replayed.
    torch_timers = {id(timer) for name, timer in given if name == "_torch_tail_rows"}
    assert torch_timers and not torch_timers & {id(timer) for name, timer in given if name != "_torch_tail_rows"}
    assert all(not timer.pending for _, timer in given)
    return sorted({(r["variant"], r["path"]) for r in sweep.rows})


def _paths(rows, variant):
    return {path for v, path in rows if v == variant}


def test_sweep_on_one_rank(tmp_path):
    rows, = run_ranks(_sweep_body, 1, args=(str(tmp_path), ["plain", "finalize", "quant"], True), backend="gloo",
                      timeout_s=300)
    # One GPU: no forced protocols, no mailbox floor, unfused-best is the strong kernels alone.
    assert _paths(rows, "plain") == {"auto", "strong-tail", "unfused-best", "unfused-nccl", "nccl_all_reduce"}
    assert _paths(rows, "finalize") == _paths(rows, "quant") == {"auto", "strong-tail", "unfused-best", "unfused-nccl"}
    notes = json.loads((tmp_path / "cpu_tp1_notes.json").read_text())
    texts = [n["text"] for n in notes]
    assert "unfused-best at H=256 (M=1, 3): no all-reduce (a group of one), the strong kernels alone" in texts
    assert "strong tail form quant H=256 (M=1, 3): row at M=1-3" in texts  # both forms timed, the faster kept
    assert "time budget H=512 (M=1, 3): stopped before M=1; not measured: 1, 3" in texts
    assert "time budget H=1024 (M=1, 3): not measured, the budget ran out before it" in texts
    assert any(t.startswith("build triton-local H=256 (M=1, 3): RuntimeError") for t in texts)  # no CUDA device here
    assert any(t.startswith("auto at H=256 (M=1, 3): runs ") for t in texts)  # scoped to the run's Ms
    skipped = {n["skipped"]["path"]: n["skipped"]["reason"] for n in notes if "skipped" in n}
    assert "refuses a group of 1" in skipped["flashinfer_all_reduce"]
    assert skipped["lamport-ar-floor"] == "a group of one has no all-reduce to bound"
    assert "symmetric memory is unavailable" in skipped["one_shot_all_reduce"]
    csv_text = (tmp_path / "cpu_tp1.csv").read_text()
    header = csv_text.splitlines()[0]
    assert header.startswith("tp,hc,hidden,variant,m,path,") and header.endswith(",speedup_vs_best")
    strong = [line for line in csv_text.splitlines() if ",strong-tail," in line]
    assert len(strong) == 6 and all(line.split(",")[8] for line in strong)  # every strong-tail row has a floor


def test_sweep_on_two_ranks(tmp_path):
    first, second = run_ranks(_sweep_body, 2, args=(str(tmp_path), ["plain", "finalize"]), backend="gloo",
                              timeout_s=300)
    assert first == second
    assert _paths(first, "plain") == {"auto", "strong-tail", "unfused-best", "unfused-nccl", "nccl_all_reduce"}
    notes = json.loads((tmp_path / "cpu_tp2_notes.json").read_text())
    assert "unfused-best at H=256 (M=1, 3): nccl_all_reduce at M=1-3" in [n["text"] for n in notes]
    skipped = {n["skipped"]["path"]: n["skipped"]["reason"] for n in notes if "skipped" in n}
    assert "flashinfer stand-in: not installed" in skipped["vllm_custom_all_reduce"]
    assert "unfused-one-shot" in skipped and "two_shot_all_reduce" in skipped


def _failing_sweep_body(rank, tp, out):
    import torch

    from lamport_mhc.bench import Ceilings, sweep as sweep_module
    from lamport_mhc.bench.strong_tail import StrongTail

    sweep_module.GraphTimer = StandInTimer
    sweep_module.StrongTail = lambda *a, **k: StrongTail(*a, **k, interpret=True)

    class FaultAtThreeRows(sweep_module._Shape):  # as a GPU fault in the row of 3 would stop the run
        def __init__(self, sweep, hidden, variant, m):
            if m == 3:
                raise RuntimeError("CUDA error: an illegal memory access was encountered\n(the stack)")
            super().__init__(sweep, hidden, variant, m)

    sweep_module._Shape = FaultAtThreeRows
    args = SimpleNamespace(paths=["strong-tail"], hc=4, rows=[1, 3], variants=["plain"], calls=50, replays=5,
                           hidden=[H], merge=None, top_k=2, backends=["triton"], compile_tail=False)
    import torch.distributed as dist

    sweep = sweep_module.Sweep(args, dist.group.WORLD, torch.device("cpu"))
    try:
        sweep.measure(H, Ceilings(None, 1000.0), Path(out), "cpu")
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def test_a_failing_sweep_keeps_what_it_measured(tmp_path):
    error, = run_ranks(_failing_sweep_body, 1, args=(str(tmp_path),), backend="gloo", timeout_s=300)
    assert error == "CUDA error: an illegal memory access was encountered"  # raised on, after the write
    rows = [line.split(",") for line in (tmp_path / "cpu_tp1.csv").read_text().splitlines()[1:]]
    assert [(row[4], row[5]) for row in rows] == [("1", "strong-tail")]
    notes = [n["text"] for n in json.loads((tmp_path / "cpu_tp1_notes.json").read_text())]
    assert (f"failed H={H} (M=1, 3): RuntimeError: CUDA error: an illegal memory access was encountered; the rows "
            "measured before it are kept") in notes
