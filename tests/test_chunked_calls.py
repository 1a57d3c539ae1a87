"""Mailboxes sized to one protocol round: calls past ``chunk_rows`` go through in parts (simulated
groups, bit for bit against the reference, across part boundaries), two instances of a group on one
workspace, the refusals of unsafe sharing, and the mailbox memory ``info`` reports."""

import csv
from types import SimpleNamespace

import pytest
import torch

from lamport_mhc import SimulatedGroup
from lamport_mhc.__main__ import main
from lamport_mhc.api import AllReduceMHC
from lamport_mhc.backend import BuildSpec
from lamport_mhc.bench import chunk_cost
from lamport_mhc.paths import FusedPath
from lamport_mhc.selector import Thresholds, mailbox_rows
from lamport_mhc.testing import check_simulated, random_inputs

EPS = 1e-20


def _group(tp, **kwargs):
    args = dict(hidden_size=64, hc_mult=4, max_num_tokens=24, top_k=6, residual_only=True, bt_min_rows=4,
                bt_min_finalize_rows=5, ll_one_kernel_rows=2, chunk_rows=8)
    return SimulatedGroup(tp, **{**args, **kwargs})


def test_mailboxes_hold_one_part_and_ll_only_what_ll_takes():
    assert mailbox_rows(8, 16384, Thresholds(37, 43)) == dict(bt=True, ll_rows=42, bt_rows=2048)
    assert mailbox_rows(8, 1000, Thresholds(37, 43), 256) == dict(bt=True, ll_rows=42, bt_rows=256)
    assert mailbox_rows(2, 1000, Thresholds(2000, 2000), 256) == dict(bt=False, ll_rows=256, bt_rows=None)
    assert mailbox_rows(1, 16384, Thresholds(37, 43)) == dict(bt=False)
    spec = BuildSpec(hidden=64, hc=4, capacity=24, top_k=6, tp=4, rank=0, bt=True, ll_rows=4, bt_rows=8)
    assert (spec.rows("ll"), spec.slots("ll"), spec.rows("bt"), spec.slots("bt"), spec.chunk_rows) == (4, 4, 8, 2, 8)


@pytest.mark.parametrize("tp,calls", [
    (2, [(9, "plain"), (9, "finalize"), (9, "residual"), (7, "finalize"), (8, "plain"), (17, "residual"),
         (23, "finalize"), (24, "plain")]),
    (3, [(9, "finalize"), (23, "plain")]),
    (8, [(17, "plain")]),
])
def test_calls_in_parts_match_the_reference(tp, calls):
    """Parts of 8 rows: M = chunk - 1, chunk, chunk + 1 (every variant), several parts, odd M and
    capacity; a last part of 1 row takes LL's one-kernel form, parts of 4 rows or more BT."""
    group = _group(tp)
    assert group.specs[0].rows("ll") == 4 and group.specs[0].rows("bt") == 8
    for m, variant in calls:
        check_simulated(group, random_inputs(tp, m, 64, 4, seed=100 * tp + m, top_k=6), variant, EPS)


def test_mxfp8_calls_in_parts_of_128_rows_match_the_reference():
    """Parts start on the scales' 128-row tiles: each writes its tiles, the last its padding rows."""
    group = SimulatedGroup(2, hidden_size=128, hc_mult=4, max_num_tokens=130, top_k=6, quantize_layer_input=True,
                           bt_min_rows=4, bt_min_finalize_rows=4, ll_one_kernel_rows=0, chunk_rows=128)
    check_simulated(group, random_inputs(2, 129, 128, 4, seed=7, top_k=6), "quant", EPS)


def test_two_groups_on_one_workspace_alternate_calls_and_variants():
    first = _group(3)
    second = _group(3, share_workspaces_with=first)
    assert second.workspaces is first.workspaces
    states = []
    for i, (group, variant, m) in enumerate([(first, "plain", 9), (second, "finalize", 3), (first, "residual", 17),
                                              (second, "plain", 8), (first, "finalize", 1), (second, "residual", 5)]):
        check_simulated(group, random_inputs(3, m, 64, 4, seed=i, top_k=6), variant, EPS)
        states.append(first.generation_state()[0])
    assert states[-1] == second.generation_state()[0]  # one set of generation words
    with pytest.raises(ValueError, match="cannot share the workspaces"):
        _group(3, hidden_size=128, share_workspaces_with=first)
    with pytest.raises(ValueError, match="cannot share the workspaces"):
        _group(3, chunk_rows=16, share_workspaces_with=first)


def test_mxfp8_parts_must_start_on_a_scale_tile():
    with pytest.raises(ValueError, match="multiple of 128"):
        SimulatedGroup(2, hidden_size=128, hc_mult=4, max_num_tokens=300, top_k=6, quantize_layer_input=True,
                       chunk_rows=100)


def _op(group="g", device="cuda:0", transport="peer", **spec):
    """An AllReduceMHC as far as sharing looks at it (no process group needed)."""
    op = object.__new__(AllReduceMHC)
    op.group, op.device = group, torch.device(device)
    op.spec = BuildSpec(**{**dict(hidden=7168, hc=4, capacity=4096, top_k=6, tp=8, rank=0, bt=True, ll_rows=42,
                                  bt_rows=2048, transport=transport), **spec})
    op.config = SimpleNamespace(transport="auto")
    op.path = FusedPath("triton", {"triton": SimpleNamespace(spec=op.spec)}, None, Thresholds(37, 43))
    return op


@pytest.mark.parametrize("other,reason", [
    (dict(group="h"), "another process group"),
    (dict(device="cuda:1"), "is on cuda:1"),
    (dict(hidden=5120), "its mailboxes are"),
    (dict(bt_rows=1024), "its mailboxes are"),
])
def test_sharing_is_refused_where_it_would_be_unsafe(other, reason):
    assert _op().sharing_refused(_op()) is None
    assert reason in _op().sharing_refused(_op(**other))
    assert "not an AllReduceMHC" in _op().sharing_refused(object())


def test_info_reports_the_mailbox_memory_per_gpu(capsys):
    assert main(["info", "--tp", "8", "--hidden", "7168", "--capacity", "16384"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("mailbox memory per GPU:"))
    assert float(line.split(":")[1].split()[0]) <= 256


def test_the_cost_of_parts_is_read_from_a_bench_table(tmp_path, capsys):
    """bench.chunk_cost: M / R calls of R rows against one call of M rows, from the auto path."""
    header = "tp,hidden,variant,m,path,us_median\n"
    lines = ["2,4096,plain,2048,auto,100.0", "2,4096,plain,4096,auto,190.0", "2,4096,plain,6144,auto,300.0",
             "2,4096,plain,4096,cute-bt,150.0", "2,4096,plain,1024,auto,55.0"]
    table = tmp_path / "t.csv"
    table.write_text(header + "\n".join(lines) + "\n")
    with table.open() as f:
        costs = chunk_cost.chunk_costs(csv.DictReader(f), 2048)
    assert [(c["m"], round(c["cost"], 4)) for c in costs] == [(4096, round(200 / 190 - 1, 4)), (6144, 0.0)]
    assert chunk_cost.main([str(table), "--chunk-rows", "2048"]) == 0
    assert "| 2 | 4096 | plain | 4096 | 190.0 | 200.0 | +5.3% |" in capsys.readouterr().out
    assert chunk_cost.main([str(table), "--chunk-rows", "512"]) == 1
