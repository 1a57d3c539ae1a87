"""The benchmark's tilekernels-tail path on CPU: registered; skipped with its reason where tile-kernels
cannot run (no tile-kernels here, another hc, a tvm_ffi that would abort TileLang's import); the
calls made with tile-kernels' conventions (a stand-in with its signatures and shape checks computing
what its kernels compute, in its own fp32 order); the norm under the Triton interpreter; a check
that passes within bf16 rounding and catches a convention mix-up; and the sweep's rows and notes."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.harness import run_ranks  # noqa: E402
from timer_stand_in import StandInTimer  # noqa: E402

from lamport_mhc import reference  # noqa: E402
from lamport_mhc.bench import PATHS, Ceilings, parse_args, write_results  # noqa: E402
from lamport_mhc.bench.names import TILEKERNELS_TAIL, whole_op_alternatives  # noqa: E402
from lamport_mhc.bench.report import read_rows  # noqa: E402
from lamport_mhc.bench.sweep import Sweep  # noqa: E402
from lamport_mhc.bench.tilekernels_tail import (NORM_FORMS, TileKernels, TileKernelsAPI, agree_bf16,  # noqa: E402
                                                shared_expert_as_route, tvm_ffi_mismatch)
from lamport_mhc.testing import bits, random_inputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")

EPS, HC, TOP_K = 1e-6, 4, 3


class StandIn:
    """tile-kernels' three functions with its argument checks, computing in fp32 in the order of its
    torch references (products summed without FMA), rounded once to bf16. ``mistake`` plants a
    convention error: "comb-transposed" (comb read [target, source]) or "pre-reversed" (pre[j]
    weighing stream hc-1-j)."""

    def __init__(self, mistake=None):
        self.mistake, self.calls = mistake, []

    def api(self) -> TileKernelsAPI:
        return TileKernelsAPI(self.mhc_post, self.mhc_pre_apply_mix, self.reduce_fused)

    def mhc_post(self, x, residual, post_layer_mix, comb_res_mix, out=None):
        seqs, tokens, hc, hidden = residual.shape
        assert x.dtype == residual.dtype == torch.bfloat16
        assert post_layer_mix.dtype == comb_res_mix.dtype == torch.float32
        assert x.shape == (seqs, tokens, hidden) and post_layer_mix.shape == (seqs, tokens, hc, 1)
        assert comb_res_mix.shape == (seqs, tokens, hc, hc)
        assert x.is_contiguous() and post_layer_mix.is_contiguous() and comb_res_mix.is_contiguous()
        self.calls.append(("mhc_post", out))
        comb = comb_res_mix.transpose(-1, -2) if self.mistake == "comb-transposed" else comb_res_mix
        # target j: x post[j] + sum over sources s of comb[s, j] res[s]
        mixed = torch.einsum("btsj,btsh->btjh", comb, residual.float())
        result = (x.float().unsqueeze(-2) * post_layer_mix + mixed).to(torch.bfloat16)
        if out is None:
            return result
        out.copy_(result)
        return out

    def mhc_pre_apply_mix(self, x, mix, out=None):
        assert mix.shape[-1] == 1 and mix.shape[-2] == x.shape[-2] and x.dtype == torch.bfloat16
        self.calls.append(("mhc_pre_apply_mix", out))
        if self.mistake == "pre-reversed":
            mix = mix.flip(-2)
        result = (x.float() * mix).sum(-2).to(torch.bfloat16)
        if out is None:
            return result
        out.view(-1, x.shape[-1]).copy_(result.view(-1, x.shape[-1]))
        return out

    def reduce_fused(self, x, topk_weights, token_topk_to_pos, fp8_format="", sf=None, out=None):
        assert x.shape[1] % 256 == 0 and fp8_format == "" and sf is None
        assert topk_weights.dtype == torch.float32 and token_topk_to_pos.dtype == torch.int32
        self.calls.append(("reduce_fused", token_topk_to_pos))
        acc = torch.zeros(token_topk_to_pos.shape[0], x.shape[1])
        for k in range(token_topk_to_pos.shape[1]):
            position = token_topk_to_pos[:, k]
            term = x[position.clamp(min=0).long()].float() * topk_weights[:, k:k + 1]
            acc = torch.where((position >= 0).unsqueeze(1), acc + term, acc)
        out.copy_(acc.to(torch.bfloat16))
        return out


class Interpreted(TileKernels):
    """The path with its Triton kernels under the interpreter (host tensors)."""

    def tail(self, hidden, top_k, interpret=False):
        return super().tail(hidden, top_k, interpret=True)


class OneRank:
    tp, rank, group = 1, 0, None

    def all_gather_object(self, obj):
        return [obj]


def _inputs(hidden, variant, m=5, seed=7):
    inputs = random_inputs(1, m, hidden, HC, seed=seed, top_k=TOP_K if variant == "finalize" else 0, permuted=True,
                           zero_row=False)
    consumer = (inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS)
    finalize = None
    if variant == "finalize":
        finalize = (inputs["gemm2s"][0], inputs["weights"][0], inputs["idxs"][0], inputs["shareds"][0])
    mxfp8 = None
    if variant == "quant":
        from lamport_mhc.mxfp8 import mxfp8_scale_bytes
        mxfp8 = (torch.full((m, hidden), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn),
                 torch.full((mxfp8_scale_bytes(m, hidden),), 0xA5, dtype=torch.uint8))
    return inputs["xs"][0], consumer, finalize, mxfp8


def _tail(stand_in, hidden):
    return Interpreted(OneRank(), HC, api_factory=stand_in.api).tail(hidden, TOP_K)


def test_the_path_is_registered_as_a_whole_op_alternative():
    assert TILEKERNELS_TAIL in PATHS and TILEKERNELS_TAIL in whole_op_alternatives(4)
    assert parse_args(["--paths", TILEKERNELS_TAIL]).paths == [TILEKERNELS_TAIL]


@pytest.mark.parametrize("variant,hidden", [("plain", 512), ("quant", 512), ("finalize", 512), ("finalize", 384),
                                            ("quant", 384)])
def test_tail_follows_tile_kernels_conventions_and_passes_its_check(variant, hidden):
    stand_in = StandIn()
    x, consumer, finalize, mxfp8 = _inputs(hidden, variant)
    call = _tail(stand_in, hidden).bind(x, consumer, finalize, mxfp8)
    for form in NORM_FORMS:
        stand_in.calls.clear()
        reduced = call.contribution()
        call.tail(reduced, form)
        agreement = call.check(reduced)
        assert agreement.failure is None, agreement.failure
        names = [name for name, _ in stand_in.calls]
        # H % 256 == 0: tile-kernels' MoE reduce; else the strong tail's finalize.
        finalized = ["reduce_fused"] if variant == "finalize" and hidden % 256 == 0 else []
        assert names == finalized + ["mhc_post", "mhc_pre_apply_mix"]
        # Outputs written in place, into the call's buffers.
        assert stand_in.calls[-2][1].data_ptr() == call.residual_out.data_ptr()
        assert stand_in.calls[-1][1].data_ptr() == call.prenorm.data_ptr()
    assert set(agreement.worst) == {"residual_out", "prenorm", "layer_input"} | (
        {"contribution"} if variant == "finalize" else set())
    assert agreement.exact_outputs == (["MXFP8 values", "MXFP8 scales"] if variant == "quant" else [])


@pytest.mark.parametrize("mistake,output", [("comb-transposed", "residual_out"), ("pre-reversed", "prenorm")])
def test_check_catches_a_convention_mix_up(mistake, output):
    x, consumer, _, _ = _inputs(512, "plain")
    call = _tail(StandIn(mistake), 512).bind(x, consumer)
    call.tail(x, "row")
    failure = call.check(x).failure
    assert failure is not None and failure.startswith(f"{output}[") and "ulps off" in failure
    assert int(failure.split("(")[-1].split()[0]) > 8


def test_agreement_is_one_bf16_rounding_or_the_terms_fp32_error():
    def bf16(values):
        return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)

    one = bf16([1.0, 1.0, -2.0, float("nan"), 0.0, float("inf")])
    near = bf16([1.0078125, 1.015625, -2.015625, float("nan"), -0.0, float("inf")])  # +1, +2, +1 ulp
    passed, ulps = agree_bf16(near, one)
    assert passed.tolist() == [True, False, True, True, True, True] and ulps.tolist() == [1, 2, 1, 0, 0, 0]
    passed, ulps = agree_bf16(bf16([1.0]), bf16([float("nan")]))
    assert not passed.any() and ulps.tolist() == [-1]
    # A sum of terms of magnitude 8 that cancelled to 2^-12: 3 ulps (3 * 2^-19) there are within the
    # terms' fp32 rounding (2^-20 * 8), 6 are not.
    small = bf16([2.0 ** -12, 2.0 ** -12])
    off = bf16([2.0 ** -12 + 3 * 2.0 ** -19, 2.0 ** -12 + 6 * 2.0 ** -19])
    assert not agree_bf16(off, small)[0].any()
    assert agree_bf16(off, small, torch.tensor([8.0, 8.0]))[0].tolist() == [True, False]
    assert agree_bf16(bf16([2.0 ** -127]), bf16([0.0]))[0].all()  # a flushed subnormal


def test_shared_expert_as_one_more_route_is_the_contracts_finalize():
    inputs = random_inputs(1, 9, 256, HC, seed=3, top_k=TOP_K, permuted=True, zero_row=False)
    gemm2, weights, indices, shared = (inputs[k][0] for k in ("gemm2s", "weights", "idxs", "shareds"))
    rows, routed_weights, routes = shared_expert_as_route(gemm2, weights, indices, shared)
    assert rows.shape == (gemm2.shape[0] + 9, 256) and routes.shape == (9, TOP_K + 1)
    assert routes.dtype == torch.int32 and routes.is_contiguous() and (routed_weights[:, -1] == 1).all()
    assert torch.equal(rows[routes[:, -1].long()], shared)
    # acc + shared rounded once: the same bits as the contract's finalize (the shared expert zero).
    with_route = reference.finalize_contribution(rows, routed_weights, routes, torch.zeros_like(shared))
    assert torch.equal(bits(with_route), bits(reference.finalize_contribution(gemm2, weights, indices, shared)))


def test_cannot_run_without_tile_kernels_or_at_another_hc(monkeypatch):
    monkeypatch.setitem(sys.modules, "tile_kernels", None)
    missing = TileKernels(OneRank(), HC)
    assert missing.reason().startswith("tile-kernels cannot be imported (rank 0: ")
    assert "pip install 'lamport-mhc[tilekernels]'" in missing.reason()
    with pytest.raises(RuntimeError, match="cannot run here"):
        missing.tail(512, TOP_K)

    def never():
        raise AssertionError("imported at hc = 2")
    assert "hc = 4 only (hc = 2 here)" in TileKernels(OneRank(), 2, api_factory=never).reason()


def test_a_tvm_ffi_beside_another_tilelang_is_refused_before_import(monkeypatch, tmp_path):
    for package in ("tilelang", "tvm_ffi", "other/tvm_ffi"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "tvm_ffi", raising=False)
    monkeypatch.delitem(sys.modules, "tilelang", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "other"), str(tmp_path)] + sys.path)
    reason = tvm_ffi_mismatch()
    assert reason is not None and str(tmp_path / "other" / "tvm_ffi") in reason and "abort" in reason
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    assert tvm_ffi_mismatch() is None


def _sweep(tmp_path, tp=1):
    """A Sweep of one CPU rank whose setup and reports run (no timing)."""
    args = SimpleNamespace(paths=None, hc=HC, rows=[1, 2], variants=["plain", "finalize"], calls=50, replays=5,
                           hidden=[256], merge=None, top_k=TOP_K, backends=["triton"], compile_tail=False)
    sweep = Sweep.__new__(Sweep)
    sweep.args, sweep.device, sweep.coll = args, torch.device("cpu"), OneRank()
    sweep.tp, sweep.rank, sweep.hc, sweep.rows_m = tp, 0, HC, [1, 2]
    sweep.rows, sweep.notes, sweep.skips = [], [], {}
    sweep.tilekernels = TileKernels(sweep.coll, HC)
    sweep.deadline, sweep.stopped = None, False
    return sweep


def test_sweep_skips_the_path_with_its_reason_where_tile_kernels_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tile_kernels", None)
    sweep = _sweep(tmp_path)
    assert sweep._tilekernels_tail(256) is None
    sweep.finish(tmp_path, "cpu", Ceilings(None, 1000.0))
    summary = (tmp_path / "cpu_tp1.md").read_text()
    for variant in ("plain", "finalize"):
        assert f"| 4 | 256 | {variant} | tilekernels-tail | all | tile-kernels cannot be imported" in summary
    sweep.args.paths = ["strong-tail"]  # not wanted: nothing asked, nothing skipped
    sweep.skips.clear()
    assert sweep._tilekernels_tail(256) is None and sweep.skips == {}


def test_merged_rows_of_the_path_replace_its_earlier_skip(tmp_path):
    """The main run skips the path (tile-kernels not importable there); a later run of the path
    alone, merged into it, leaves no stale skip beside its rows."""
    args = SimpleNamespace(calls=50, replays=5, hidden=[256])
    skip = {"hidden": 256, "text": "skipped tilekernels-tail hc=4 plain H=256: no tile-kernels",
            "skipped": {"hc": 4, "variant": "plain", "path": TILEKERNELS_TAIL, "m": "all", "reason": "no tile-kernels"}}
    other = {**skip, "text": skip["text"].replace("plain", "quant"), "skipped": {**skip["skipped"], "variant": "quant"}}
    write_results([], [skip, other], tmp_path / "first", "cpu", 1, Ceilings(None, 1000.0), args)
    row = dict(tp=1, hc=4, hidden=256, variant="plain", m=8, path=TILEKERNELS_TAIL, us_median=3.0, us_min=3.0,
               us_max=3.0, floor_us=None, ratio_to_floor=None, speedup_vs_unfused=None, speedup_vs_best=None)
    args.merge = str(tmp_path / "first" / "cpu_tp1.csv")
    write_results([row], [], tmp_path / "second", "cpu", 1, Ceilings(None, 1000.0), args, args.merge)
    notes = json.loads((tmp_path / "second" / "cpu_tp1_notes.json").read_text())
    assert [n["skipped"]["variant"] for n in notes if "skipped" in n] == ["quant"]  # quant was not measured


def test_a_main_run_merged_over_the_paths_rows_keeps_them_and_notes_its_skip(tmp_path):
    """The other order: the path timed alone first, then the main run (which cannot import it)
    merged over it. Its rows stay, and the main run's skip becomes a note beside them, where a skip
    of every M would contradict them; a skip of the path at a variant without rows stays a skip."""
    args = SimpleNamespace(calls=50, replays=5, hidden=[256])
    row = dict(tp=1, hc=4, hidden=256, variant="plain", m=8, path=TILEKERNELS_TAIL, us_median=3.0, us_min=3.0,
               us_max=3.0, floor_us=None, ratio_to_floor=None, speedup_vs_unfused=None, speedup_vs_best=None)
    write_results([row], [], tmp_path / "first", "cpu", 1, Ceilings(None, 1000.0), args)
    skips = [{"hidden": 256, "text": f"skipped tilekernels-tail hc=4 {v} H=256: no tile-kernels",
              "skipped": {"hc": 4, "variant": v, "path": TILEKERNELS_TAIL, "m": "all", "reason": "no tile-kernels"}}
             for v in ("plain", "quant")]
    args.merge = str(tmp_path / "first" / "cpu_tp1.csv")
    main_row = {**row, "path": "auto", "us_median": 2.0}
    for out in ("second", "third"):  # merged twice: the note is not repeated
        write_results([main_row], skips, tmp_path / out, "cpu", 1, Ceilings(None, 1000.0), args, args.merge)
        args.merge = str(tmp_path / out / "cpu_tp1.csv")
    notes = json.loads((tmp_path / "third" / "cpu_tp1_notes.json").read_text())
    assert [n["skipped"]["variant"] for n in notes if "skipped" in n] == ["quant"]
    kept = [n["text"] for n in notes if n["text"].startswith("tilekernels-tail hc=4 plain H=256")]
    assert kept == ["tilekernels-tail hc=4 plain H=256: rows of cpu_tp1.csv kept (not run here: no tile-kernels)"]
    paths = [r["path"] for r in read_rows(tmp_path / "third" / "cpu_tp1.csv")]
    assert sorted(paths) == ["auto", TILEKERNELS_TAIL]

    # The path timed alone again, merged over that: its new rows leave no note that they were kept.
    write_results([{**row, "us_median": 2.5}], [], tmp_path / "fourth", "cpu", 1, Ceilings(None, 1000.0), args,
                  args.merge)
    notes = json.loads((tmp_path / "fourth" / "cpu_tp1_notes.json").read_text())
    assert not [n["text"] for n in notes if "kept" in n["text"]]
    assert [n["skipped"]["variant"] for n in notes if "skipped" in n] == ["quant"]


def _sweep_body(rank, tp, out):
    """The sweep of the path alone on gloo ranks, tile-kernels' stand-in, the kernels interpreted and
    every path called once instead of timed."""
    import torch.distributed as dist

    from lamport_mhc.bench import sweep as sweep_module
    from lamport_mhc.bench.strong_tail import StrongFinalize

    sweep_module.GraphTimer = StandInTimer
    sweep_module.StrongFinalize = lambda *a, **k: StrongFinalize(*a, **k, interpret=True)
    args = SimpleNamespace(paths=[TILEKERNELS_TAIL], hc=HC, rows=[1, 3], variants=["plain", "finalize", "quant"],
                           calls=50, replays=5, hidden=[256], merge=None, top_k=TOP_K, backends=["triton"],
                           compile_tail=False)
    sweep = sweep_module.Sweep(args, dist.group.WORLD, torch.device("cpu"))

    def no_flashinfer():
        raise ImportError("flashinfer stand-in: not installed")

    sweep.flashinfer.api_factory = no_flashinfer
    sweep.tilekernels = Interpreted(sweep.coll, HC, api_factory=StandIn().api)
    ceilings = Ceilings(None if tp == 1 else 100.0, 1000.0)
    sweep.run_hidden(256, ceilings)
    sweep.finish(Path(out), "cpu", ceilings)
    return sorted((r["variant"], r["m"], r["path"], r["floor_us"] is not None) for r in sweep.rows)


@pytest.mark.parametrize("tp", [1, 2])
def test_sweep_times_the_path_at_every_shape(tmp_path, tp):
    results = run_ranks(_sweep_body, tp, args=(str(tmp_path),), backend="gloo", timeout_s=300)
    assert all(r == results[0] for r in results)
    # tp = 1: the whole op, with the strong tail's floor; tp = 2: after the all-reduce, no floor.
    assert results[0] == sorted((v, m, TILEKERNELS_TAIL, tp == 1) for v in ("plain", "finalize", "quant")
                                for m in (1, 3))
    notes = json.loads((tmp_path / f"cpu_tp{tp}_notes.json").read_text())
    texts = [n["text"] for n in notes]
    # A run of some rows (M = 1, 3) scopes its notes to them.
    check = next(t for t in texts if t.startswith("tilekernels-tail check H=256 (M=1, 3): "))
    assert "contribution" in check and "MXFP8 scales and MXFP8 values exact" in check
    assert any(t.startswith("tilekernels-tail norm form quant H=256 (M=1, 3): ") for t in texts)
    if tp == 2:
        assert "tilekernels-tail at H=256 (M=1, 3): nccl_all_reduce at M=1-3 (of nccl_all_reduce)" in texts
    # Candidates only this path asked for are not reported as skipped (symmetric memory, FlashInfer).
    assert not [n for n in notes if "skipped" in n]
