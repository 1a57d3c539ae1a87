"""The form forcer of ``bench/local_forms.py`` on the simulated group's Triton kernels: every form
it forces is the one the call launches, where the plan has it, and ``reset`` puts the measured
windows back."""

import pytest

from lamport_mhc import SimulatedGroup
from lamport_mhc.bench.local_forms import FORMS, FormForcer

HC, TOP_K = 4, 6


def _kernels(hidden):
    group = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=64, top_k=TOP_K,
                           quantize_layer_input=True)
    kernels = group.paths[0].kernels["triton"]
    kernels.resident = 132  # windows as on an H200
    kernels.derive_bounds()
    return kernels


def _chosen(kernels, variant, m, local_x=True):
    launched = []
    kernels._launch = lambda name, *args, **overrides: launched.append(name)
    prefix = "local" if local_x else "local_finalize"
    kernels._launch_consumer(f"{prefix}_{variant}", m, variant=variant, local=True, local_x=local_x,
                             streamed=kernels._streamed(_Call(variant, m)))
    return launched[-1]


class _Call:
    def __init__(self, variant, m):
        self.variant, self.m = variant, m


@pytest.mark.parametrize("form,hinted,plain,quant", [
    ("cooperative", None, "local_plain_split", "local_quant_split"),
    ("parked", False, "local_plain", "local_quant"),
    ("parked", True, "local_plain_streamed", "local_quant_streamed"),
    ("wide", False, "local_plain_wide", "local_quant_wide"),
    ("wide", True, "local_plain_wide_streamed", "local_quant_wide_streamed"),
    ("held", False, "local_plain", "local_quant"),  # no held twin at 7168 (the wide one takes many rows): parked
    ("broad", False, "local_plain_broad", "local_quant_wide"),  # no quant broad twin
    ("broad", True, "local_plain_broad", "local_quant_wide_streamed"),  # the broad twin has no hinted one
    ("broad-held", False, "local_plain_broad_held", "local_quant_broad_held"),
    ("broad-held", True, "local_plain_broad_held_streamed", "local_quant_broad_held_streamed"),
])
def test_forced_forms_are_launched_where_the_plan_has_them(form, hinted, plain, quant):
    kernels = _kernels(7168)
    forcer = FormForcer(kernels)
    def windows():
        return (dict(kernels.local_split_windows), dict(kernels.wide_rows), dict(kernels.local_x_broad_windows),
                dict(kernels.local_x_broad_held_windows), dict(kernels.local_x_hinted_broad_held_windows))

    measured = windows()
    forcer.force(form, hinted)
    assert _chosen(kernels, "plain", 200) == plain and _chosen(kernels, "quant", 200) == quant
    forcer.reset()
    assert windows() == measured
    assert kernels.l2_bytes is None and _chosen(kernels, "plain", 200) == "local_plain_wide"


def test_the_held_twin_where_the_plan_has_one():
    kernels = _kernels(5120)  # quant: no wide twin, a held one
    FormForcer(kernels).force("held", False)
    assert _chosen(kernels, "quant", 200) == "local_quant_held" and _chosen(kernels, "plain", 200) == "local_plain"


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="form must be one of"):
        FormForcer(_kernels(4096)).force("looped")
    assert set(FORMS) == {"cooperative", "parked", "wide", "held", "broad", "broad-held"}


def test_kernel_launched_names_the_last_kernel_a_call_launched_and_unhooks():
    from lamport_mhc.bench.local_forms import kernel_launched
    from lamport_mhc.testing import call_simulated, random_inputs

    group = SimulatedGroup(1, hidden_size=1024, hc_mult=HC, max_num_tokens=64, top_k=TOP_K,
                           quantize_layer_input=True)
    kernels = group.paths[0].kernels["triton"]
    FormForcer(kernels).force("parked", False)
    inputs = random_inputs(1, 3, 1024, HC, seed=3, top_k=TOP_K)
    outputs, kernel = kernel_launched(kernels, lambda: call_simulated(group, inputs, "quant", 1e-6))
    assert kernel == "local_quant" and len(outputs) == 1 and kernels.on_launch is None
    with pytest.raises(ZeroDivisionError):
        kernel_launched(kernels, lambda: 1 / 0)
    assert kernels.on_launch is None


def test_cold_rows_take_three_l2s_and_give_each_call_the_next_copy():
    import torch

    from lamport_mhc.bench.local_forms import ColdRows, row_inputs

    row = row_inputs(256, "quant", 5, torch.device("cpu"))
    x, consumer, mxfp8, _ = row
    outputs = consumer[0].numel() * 2 + x.numel() * 2  # the residual streams and the layer input, bf16
    inputs = sum(t.numel() * t.element_size() for t in (x, *consumer[:5], *mxfp8))
    assert ColdRows.row_bytes(row) == inputs + outputs
    assert ColdRows.cold_count(1000, 1000, 50) == 3 and ColdRows.cold_count(999, 1000, 50) == 4
    assert ColdRows.cold_count(10**9, 1000, 50) == 2 and ColdRows.cold_count(1, 1000, 50) == 50
    drawn = []
    copies = ColdRows(row, 3, lambda: drawn.append(1) or row_inputs(256, "quant", 5, torch.device("cpu")))
    assert len(drawn) == 2 and len(copies.rows) == 3
    turns = [copies.next() for _ in range(4)]
    assert turns[0] is row and turns[3] is row and turns[1] is not turns[2]
    assert turns[1][0].data_ptr() != row[0].data_ptr() and torch.equal(turns[1][0], row[0])
