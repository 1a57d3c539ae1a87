"""The Triton kernels under the interpreter, in a simulated TP group: every rank's outputs are
bit-identical to the reference, and LL to BT, for every variant, over calls that cycle the
generations with M changing every call."""

import pytest
import torch

from lamport_mhc import SimulatedGroup
from lamport_mhc.paths import FusedPath
from lamport_mhc.testing import assert_outputs_match, call_simulated, check_simulated, random_inputs
from lamport_mhc.traffic import STREAMED_ROWS, streams_past_l2
from kernels_triton.backend import UNBOUNDED, wide_window
from kernels_triton.plan import HELD_MIN_ROWS, row_chunks
from kernels_triton.spread import Spread

EPS = 1e-20  # DeepSeek-V4.1's rms_norm_eps

HC, TOP_K, CAPACITY = 4, 3, 9
VARIANTS = ("plain", "finalize", "quant", "residual")
SIZES = (1, 2, 7, CAPACITY)


ONE_KERNEL_ROWS = 2  # LL calls of 1 or 2 rows run as one kernel, larger ones as publish + consumer
SPLIT_ROWS = 1  # a call of one row spreads its token over a program per chunk (rows of several chunks)


def _group(tp, hidden, bt_min_rows=None):
    return SimulatedGroup(tp, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                          quantize_layer_input=hidden % 128 == 0, residual_only=True, bt_min_rows=bt_min_rows,
                          bt_min_finalize_rows=bt_min_rows, ll_one_kernel_rows=ONE_KERNEL_ROWS,
                          split_rows=SPLIT_ROWS)


# Rows of one chunk (256, 384, 1024) and of several: 1408 = 3 x 512 (the last chunk half padding),
# 2304 = 9 x 256 (more chunks than the local streaming form holds, which parks the row, and than a
# cluster holds: no cooperative form), 3072 = 3 x 1024
# and 7168 = 7 x 1024.
@pytest.mark.parametrize("tp,hidden", [(1, 256), (2, 256), (3, 384), (4, 256), (8, 256), (2, 1024), (3, 1024),
                                       (1, 1408), (2, 1408), (5, 1408), (8, 1408), (1, 2304), (1, 3072), (3, 3072),
                                       (1, 7168), (2, 7168)])
def test_ll_and_bt_match_the_reference(tp, hidden):
    ll = _group(tp, hidden)
    # A group of one has one protocol (local), whatever the thresholds: it runs once.
    bt = _group(tp, hidden, bt_min_rows=1) if tp > 1 else None
    if bt is None:
        assert all(path.spec.protocols == ("local",) for path in ll.paths)
    for call, (m, variant) in enumerate((m, v) for m in SIZES for v in VARIANTS):
        inputs = random_inputs(tp, m, hidden, HC, seed=1000 * tp + call, top_k=TOP_K)
        ll_out = check_simulated(ll, inputs, variant, EPS)
        if bt is None:
            continue
        bt_out = check_simulated(bt, inputs, variant, EPS)
        for a, b in zip(ll_out[0], bt_out[0]):  # LL and BT: the same bits (via the reference, and directly)
            if a is not None:
                for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("tp,hidden,hc", [(1, 1408, 3), (2, 2048, 3), (1, 2048, 2), (2, 1408, 1)])
def test_fewer_streams_than_the_tile_holds(tp, hidden, hc):
    """hc = 1, 2 or 3 (the streams' tile padded to a power of two rows, the padding masked off),
    rows whose chunks tile them (2048) or overhang them (1408), local and mailbox calls: the bits are
    the reference's."""
    group = SimulatedGroup(tp, hidden_size=hidden, hc_mult=hc, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, residual_only=True, split_rows=SPLIT_ROWS)
    for call, (m, variant) in enumerate(((1, "plain"), (3, "quant"), (2, "finalize"), (3, "residual"))):
        check_simulated(group, random_inputs(tp, m, hidden, hc, seed=100 * hc + call, top_k=TOP_K), variant, EPS)


def test_generations_cycle_with_m_changing_every_call():
    """30 calls, M, protocol and LL's kernel form changing every call: the generation state rotates
    per protocol."""
    group = _group(2, 1408, bt_min_rows=5)
    sizes = [1, 9, 2, 7, 5, 4, 9, 1, 6, 3] * 3
    ll_calls = bt_calls = cooperative_calls = 0
    for call, m in enumerate(sizes):
        check_simulated(group, random_inputs(2, m, 1408, HC, seed=call, top_k=TOP_K), VARIANTS[call % 4], EPS)
        cooperative_calls += m <= SPLIT_ROWS and VARIANTS[call % 4] != "residual"
        if m >= 5:
            bt_calls += 1
        else:
            ll_calls += 1
        for state in group.generation_state():
            assert state["ll"][0] == ll_calls % 3 and state["bt"][0] == bt_calls % 3
            assert state["ll"][2] == 0  # the one-kernel form's arrival count is reset by its last program
    assert ll_calls > 3 and bt_calls > 3 and cooperative_calls > 3


def test_calls_routed_to_different_kernel_sets_share_one_workspace():
    """``auto`` with per-call routes runs consecutive calls on different backends over one workspace:
    two kernel sets built over the same mailboxes and state, taking turns by M (and rank 1 using the
    other set than rank 0 for half the calls), keep every output exact and the generations in step."""
    from lamport_mhc.backend import load_backend

    group = _group(2, 256, bt_min_rows=5)
    triton = load_backend("triton")
    seen = set()

    def route_of(rank):
        def route(call):  # by M's parity; for calls of 5 rows and more, rank 1 takes the other set
            name = "first" if (call.m + rank * (call.m > 4)) % 2 else "second"
            seen.add((rank, call.m > 4, name))
            return name
        return route

    for rank, path in enumerate(group.paths):
        sets = {"first": path.kernels["triton"], "second": triton.build(path.spec, path.workspace, interpret=True)}
        group.paths[rank] = FusedPath(path.name, sets, path.workspace, path.thresholds, route_of(rank))
    for call, m in enumerate([1, 2, 9, 6, 3, 4, 7, 8, 5, 2, 1, 9] * 2):
        check_simulated(group, random_inputs(2, m, 256, HC, seed=call, top_k=TOP_K), VARIANTS[call % 4], EPS)
    assert seen == {(rank, big, name) for rank in (0, 1) for big in (False, True) for name in ("first", "second")}


@pytest.mark.parametrize("tp,hidden", [(2, 256), (1, 256), (1, 1408)])
def test_nan_inf_and_signed_zero_inputs(tp, hidden):
    """NaN and Inf travel through every step with the reference's bits (no NaN is the sentinel), the
    mix and norm weights' too, and a reduced -0.0 is +0.0: where x and every stream are -0.0, the
    mixed streams are +0.0."""
    group = _group(tp, hidden, bt_min_rows=4 if tp > 1 else None)
    for m in (3, 8):
        inputs = random_inputs(tp, m, hidden, HC, seed=m, top_k=TOP_K)
        inputs["xs"][0][1, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        inputs["xs"][-1][1, 4:8] = torch.tensor([-0.0, -0.0, float("nan"), 1.0])
        inputs["residual"][1, 2, 8:12] = torch.tensor([float("inf"), float("nan"), -0.0, -0.0])
        for x in inputs["xs"]:
            x[1, 12:16] = -0.0
        inputs["residual"][1, :, 12:16] = -0.0
        inputs["post"][1, 1] = float("nan")
        inputs["shareds"][0][1, :3] = torch.tensor([float("inf"), -0.0, float("nan")])
        # The mix and norm weights are data too: the contract says what NaN and Inf in them give.
        inputs["comb"][2, 0, 3] = float("inf")
        inputs["pre"][2, 2] = float("nan")
        inputs["norm_weight"][5] = -float("inf")
        for variant in VARIANTS:
            check_simulated(group, inputs, variant, EPS)


def test_huge_eps_and_tiny_eps():
    group = _group(3, 384)
    inputs = random_inputs(3, 7, 384, HC, seed=5, top_k=TOP_K)
    for eps in (1e-20, 1e-6, 0.5, 0.0):
        check_simulated(group, inputs, "quant", eps)


@pytest.mark.parametrize("m", [ONE_KERNEL_ROWS, ONE_KERNEL_ROWS + 1])
def test_missing_peer_becomes_a_runtime_error(m):
    """The spin bound of the interpreter: a consumer whose peer never published reports which rank,
    generation and token it waited for, instead of hanging (LL in one kernel and in two)."""
    group = _group(2, 256)
    inputs = random_inputs(2, m, 256, HC, seed=0)
    from lamport_mhc import validate
    call = validate.plain_call(group.specs[0], group.device, inputs["xs"][0], inputs["residual"], inputs["post"],
                               inputs["comb"], inputs["pre"], inputs["norm_weight"], 1e-6, None)
    path: FusedPath = group.paths[0]
    path.publish(call, "ll")  # rank 1 never publishes
    path.consume(call, "ll")
    with pytest.raises(RuntimeError, match=r"rank 0: spin timeout waiting for rank 1's contribution to token 0 of "
                                           r"generation 0"):
        path.raise_on_timeout()


def test_torch_backend_in_the_simulated_group_matches_triton():
    triton_group = _group(3, 256, bt_min_rows=2)
    torch_group = SimulatedGroup(3, hidden_size=256, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                                 backend="torch", quantize_layer_input=True, residual_only=True)
    for m, variant in ((1, "plain"), (7, "finalize"), (9, "quant"), (2, "residual")):
        inputs = random_inputs(3, m, 256, HC, seed=m, top_k=TOP_K)
        a = call_simulated(triton_group, inputs, variant, EPS)
        b = call_simulated(torch_group, inputs, variant, EPS)
        for rank in range(3):
            assert_outputs_match(a[rank], (b[rank][0], b[rank][1], b[rank][2]))


@pytest.mark.parametrize("hc", [1, 3, 6])
def test_other_stream_counts(hc):
    """hc need not be a power of two: the streams are padded and masked in the kernels."""
    group = SimulatedGroup(2, hidden_size=128, hc_mult=hc, max_num_tokens=5, top_k=2, quantize_layer_input=True,
                           residual_only=True, bt_min_rows=3, bt_min_finalize_rows=3)
    for m, variant in ((1, "plain"), (5, "finalize"), (2, "quant"), (4, "residual")):
        check_simulated(group, random_inputs(2, m, 128, hc, seed=m, top_k=2), variant, EPS)


@pytest.mark.parametrize("tp,hidden,split_rows", [(1, 1408, 0), (2, 1408, 3), (1, 7168, 0), (1, 7168, 3)])
def test_norm_sums_each_chunk_by_the_contracts_tree(tp, hidden, split_rows):
    """A prenormalized row of one 4096 and then ones: the contract's tree keeps every 1.0 but the
    one paired with 4096^2 = 2^24, a sum that adds them to 2^24 one at a time loses them all (an
    rms 0.004% smaller at H = 1408: about one output in a hundred changes). Random rows beside it. In the
    latency form the roots each token's chunks park are checked too: the contract's
    chunk trees, bit for bit, so any other order within a chunk fails (both forms compute a chunk's
    root with the same function). The prenormalized row is residual stream 0 (post 0, identity
    comb, pre picking stream 0)."""
    from lamport_mhc.bits import pairwise_sum

    rows = 3
    group = SimulatedGroup(tp, hidden_size=hidden, hc_mult=HC, max_num_tokens=rows, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=split_rows)
    inputs = random_inputs(tp, rows, hidden, HC, seed=hidden, top_k=TOP_K, zero_row=False)
    inputs["residual"][0, 0] = 1.0
    inputs["residual"][0, 0, 0] = 4096.0
    inputs["post"].zero_()
    inputs["comb"].copy_(torch.eye(HC).expand(rows, HC, HC))
    inputs["pre"].zero_()
    inputs["pre"][:, 0] = 1.0
    squares = inputs["residual"][:, 0].float() ** 2
    one_at_a_time = torch.tensor(2.0 ** 24)
    for square in squares[0, 1:]:
        one_at_a_time = one_at_a_time + square
    assert one_at_a_time == 2.0 ** 24 and pairwise_sum(squares[0]) == 2.0 ** 24 + hidden - 2
    for variant in ("plain", "quant"):
        check_simulated(group, inputs, variant, EPS)
        if split_rows >= rows:
            chunk, chunks = row_chunks(hidden)
            expected = torch.stack([pairwise_sum(squares[:, i * chunk:(i + 1) * chunk]) for i in range(chunks)], -1)
            for path in group.paths:
                kernels = path.kernels["triton"]
                roots = kernels.parked_roots.view(-1, chunks)[:rows]
                assert torch.equal(roots.view(torch.int32), expected.view(torch.int32))


def test_latency_form_bound_and_residency():
    """A call takes the latency form up to ``split_rows`` rows; LL's one-kernel form only while a
    program per chunk of every row is resident (its programs wait for their twins on other ranks)."""
    group = SimulatedGroup(2, hidden_size=1408, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, split_rows=4)
    kernels = group.paths[0].kernels["triton"]
    assert kernels.chunks == 3 and kernels.split_rows == 4
    assert [kernels._split(m) for m in (1, 4, 5)] == [3, 3, 1]
    kernels.resident = 6  # as if the GPU held six programs at once
    assert [kernels._split(m, waits_for_twins=True) for m in (1, 2, 3)] == [3, 3, 1]
    assert kernels._split(3) == 3  # a consumer after its publish waits for nothing it could block
    one_chunk = SimulatedGroup(1, hidden_size=1024, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, split_rows=4)
    assert one_chunk.paths[0].kernels["triton"]._split(1) == 1  # a row of one chunk has no latency form


def _on_132_sms(hidden: int, model: str | None = None):
    """The Triton kernels of a group of one at ``hidden``, their bounds derived as on 132 SMs (of
    ``model``, where given: its ``MODEL_WINDOWS``)."""
    kernels = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                             quantize_layer_input=True).paths[0].kernels["triton"]
    kernels.resident = 132
    kernels.model = model
    kernels.derive_bounds()
    return kernels


@pytest.mark.parametrize("hidden,plain,quant,finalize", [
    (4096, ((0, 112), (132, 165)), ((0, 112), (132, 178)), 184), (5120, ((0, 92), (132, 198)), ((0, 198),), 231),
    (7168, ((0, 101), (132, 178)), ((0, 101), (132, 198)), 231), (1408, ((0, 308),), ((0, 308),), 308)])
def test_local_calls_take_the_cooperative_form_as_measured(hidden, plain, quant, finalize):
    """On 132 SMs the local calls take the cooperative form in the windows of rows per SM measured for
    their row's chunks (4, 5, 7): the calls of x by variant, the finalize's up to 1.4-1.75 rows per SM.
    Other widths, the residual variant and calls with a mailbox: while 7 programs per SM hold them."""
    kernels = _on_132_sms(hidden)
    assert kernels.split_rows == 7 * 132 // kernels.chunks
    for local_x in (True, False):
        assert kernels.local_split_windows["residual", local_x] == ((0, kernels.split_rows),)
    expected_windows = {("plain", True): plain, ("quant", True): quant, ("plain", False): ((0, finalize),),
                        ("quant", False): ((0, finalize),)}
    for key, windows in expected_windows.items():
        assert kernels.local_split_windows[key] == windows, key
        for above, most in windows:
            rows = (above, above + 1, most, most + 1) if above else (1, most, most + 1)
            expected = [kernels.chunks if above < m <= most else 1 for m in rows]
            assert [kernels._split(m, local=key) for m in rows] == expected
            assert expected[0] == (1 if above else kernels.chunks) and expected[-1] == 1
    assert kernels._split(kernels.split_rows) == kernels.chunks  # a call with a mailbox


def _recording_launches(kernels) -> list[str]:
    """The names of the kernels ``kernels`` launches from now on, in order."""
    launched = []
    launch = kernels._launch
    kernels._launch = lambda name, *args, **overrides: (launched.append(name), launch(name, *args, **overrides))
    return launched


@pytest.mark.parametrize("hidden,variant,m,hinted", [
    (5120, "plain", 512, True), (5120, "quant", 448, False), (5120, "finalize", 320, True),
    (7168, "finalize", 256, True), (7168, "plain", 384, True), (7168, "quant", 320, False),
    (4096, "plain", 640, False), (4096, "finalize", 384, False), (4096, "plain", 768, True),
    (4096, "finalize", 256, False), (7168, "finalize", 192, False)])
def test_calls_take_the_hints_from_the_measured_fraction_of_the_l2(hidden, variant, m, hinted):
    """On 60 MiB of L2, top-8: from 0.8 of it at H = 5120 and 7168 past 256 rows (5120 quant M = 448
    moves 0.77), from all of it at 4096 (plain M = 640 0.83, 768 1.00) and up to 256 rows (the finalize
    of 256 rows at 7168 1.05, of 192 rows 0.79)."""
    assert streams_past_l2(variant, m, hidden, HC, 8, 60 << 20) == hinted


@pytest.mark.parametrize("l2_mib,hidden,m,hinted", [
    (50, 7168, 256, True), (60, 7168, 256, False), (50, 5120, 256, False), (50, 7168, 128, False)])
def test_few_rows_take_the_hints_only_past_the_whole_l2(l2_mib, hidden, m, hinted):
    """The top-6 finalize of 256 rows at H = 7168 moves 1.12 x an H100's 50 MiB of L2 (hinted, as
    measured there) but 0.93 x an H200's 60; at 5120 it moves 0.80 x 50 MiB, the fraction that
    takes the hints past 256 rows; 128 rows are below the window."""
    assert streams_past_l2("finalize", m, hidden, HC, 6, l2_mib << 20) == hinted


def _chosen_kernels(kernels) -> list[str]:
    """The names of the kernels ``kernels`` would launch from now on, in order; nothing runs."""
    chosen = []
    kernels._launch = lambda name, *args, **overrides: chosen.append(name)
    return chosen


def test_local_calls_take_the_hinted_twins_in_their_window():
    """Local calls of lo < M <= hi rows that move at least the L2's bytes run the streaming
    consumers' ``_streamed`` twins (x and finalize); smaller calls, calls outside the window and the
    cooperative form run the plain kernels. The bits are the reference's either way."""
    hidden = 1408
    group = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=1)
    kernels = group.paths[0].kernels["triton"]
    assert kernels.streamed_rows == STREAMED_ROWS and kernels.l2_bytes is None  # no GPU, no L2: never
    kernels.streamed_rows = (1, 4)
    row = 2 * hidden
    kernels.l2_bytes = 3 * (row + 2 * HC * row + row)  # what three plain rows move
    launched = _recording_launches(kernels)
    for m, variant in ((1, "plain"), (2, "quant"), (3, "plain"), (2, "finalize"), (4, "finalize"), (5, "quant")):
        check_simulated(group, random_inputs(1, m, hidden, HC, seed=m, top_k=TOP_K), variant, EPS)
    assert launched == ["local_plain_split", "local_plain_split",  # the cooperative form: mix, then normalize
                        "local_quant", "local_plain_wide_streamed", "local_finalize_plain",
                        "local_finalize_plain_streamed", "local_quant"]


def test_local_calls_of_many_rows_take_the_held_twins():
    """Rows of up to seven chunks: local calls of x of at least ``held_rows`` rows run the ``_held``
    twin (the row in registers) where no wide twin takes them (quant at this width: plain takes its
    wide twin), smaller calls the parked form; the finalize always parks. The bits are the
    reference's either way."""
    hidden = 2560
    assert row_chunks(hidden) == (512, 5)
    group = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=1)
    kernels = group.paths[0].kernels["triton"]
    assert kernels.held_rows == HELD_MIN_ROWS > STREAMED_ROWS[1]  # no call would want both twins
    kernels.held_rows = 3
    launched = _recording_launches(kernels)
    for m, variant in ((2, "quant"), (3, "quant"), (4, "plain"), (3, "finalize")):
        check_simulated(group, random_inputs(1, m, hidden, HC, seed=m, top_k=TOP_K), variant, EPS)
    assert launched == ["local_quant", "local_quant_held", "local_plain_wide", "local_finalize_plain"]
    assert "local_plain_held" not in kernels.plan


def test_local_calls_of_x_take_the_held_twin_in_their_measured_window():
    """On 132 SMs the local quant calls of x at H = 5120 take the held twin also while one wave of its
    programs holds them (561-660 rows); the other widths and variants, and the finalize, only from
    ``held_rows``."""
    kernels = _on_132_sms(5120)
    assert kernels.local_x_held_windows == {"plain": (), "quant": ((561, 660),), "residual": ()}
    assert "local_quant_held" in kernels.plan and "local_finalize_quant_held" not in kernels.plan
    launched = _chosen_kernels(kernels)
    for m in (561, 562, 660, 661):
        kernels._launch_consumer("local_quant", m, variant="quant", local=True, local_x=True)
    assert launched == ["local_quant", "local_quant_held", "local_quant_held", "local_quant"]
    assert all(not any(other.local_x_held_windows.values()) for other in (_on_132_sms(4096), _on_132_sms(7168)))


def test_local_calls_take_the_wide_twins_outside_their_window():
    """Local streaming calls of at most ``wide_rows[variant, local_x][0]`` or at least ``[1]`` rows
    run the ``_wide`` twins where the plan has them: plain and finalize (chunks twice as wide); quant
    where they tile the row, and there the held twin is not built, or in chunks four times as wide
    (H = 7168, below). The interpreter takes a wide twin at every M where it takes the calls of many
    rows (plain calls of x), else never. The bits are the reference's."""
    hidden = 1408  # 3 chunks of 512; the wide twins' 2 x 1024 overhang the row
    group = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=0)
    kernels = group.paths[0].kernels["triton"]
    assert {key for key, (fewest, most) in kernels.wide_rows.items() if fewest == most == 0} == {("plain", True)}
    assert all(most > CAPACITY for key, (_, most) in kernels.wide_rows.items() if key != ("plain", True))
    kernels.wide_rows = {key: (1, 4) for key in kernels.wide_rows}
    launched = _recording_launches(kernels)
    for m, variant in ((1, "plain"), (2, "plain"), (4, "finalize"), (1, "quant")):
        check_simulated(group, random_inputs(1, m, hidden, HC, seed=m, top_k=TOP_K), variant, EPS)
    assert launched == ["local_plain_wide", "local_plain", "local_finalize_plain_wide", "local_quant"]
    tiled = SimulatedGroup(1, hidden_size=2048, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=0).paths[0].kernels["triton"]
    assert tiled.wide_rows["quant", True] == (0, 0) and "local_quant_wide" in tiled.plan
    assert "local_plain_held" not in tiled.plan


@pytest.mark.parametrize("hidden,variant,local_x,window", [
    (4096, "plain", True, (264, 396)), (4096, "quant", True, (264, 396)), (5120, "plain", True, (132, 726)),
    (7168, "plain", True, (264, 726)), (7168, "quant", True, (264, 561)),
    (4096, "plain", False, (264, 528)), (5120, "plain", False, (264, UNBOUNDED)), (1408, "plain", True, (264, 528))])
def test_wide_windows_as_measured(hidden, variant, local_x, window):
    """On 132 SMs the local calls of x take the wide twins at the rows per SM measured for their row's
    chunks and variant (the four-chunk twin of H = 7168 quant also while an SM holds one); the
    finalize and unmeasured widths at the general bounds (many rows only where the wide twin takes them)."""
    assert wide_window(hidden, variant, local_x, 132) == window


def _local_forms_of_x(kernels, variant: str, rows) -> dict[int, str]:
    """The kernel each local call of x of ``rows`` rows would launch last (the interpreter runs a
    cooperative call as two launches); nothing runs."""
    launched, chosen = _chosen_kernels(kernels), {}
    for m in rows:
        kernels._launch_consumer(f"local_{variant}", m, variant=variant, local=True, local_x=True)
        chosen[m] = launched[-1]
    return chosen


@pytest.mark.parametrize("hidden,variant,rows", [
    # H = 7168 plain: broad at about one row per SM and from 1452 rows, parked at 7-8 rows per SM.
    (7168, "plain", {101: "local_plain_split", 102: "local_plain_wide", 112: "local_plain_wide",
                     113: "local_plain_broad", 132: "local_plain_broad", 133: "local_plain_split",
                     256: "local_plain_wide", 512: "local_plain", 924: "local_plain_wide", 925: "local_plain",
                     1056: "local_plain", 1057: "local_plain_wide", 1453: "local_plain_broad",
                     2112: "local_plain_broad", 2113: "local_plain_wide"}),
    # the wide twin's few rows hinted (H = 4096 quant up to 2 rows per SM, 7168 quant up to 1, but for
    # the broad held twin's hinted window there: above 0.84, at most 1 row per SM).
    (4096, "plain", {128: "local_plain_wide", 264: "local_plain_wide", 300: "local_plain",
                     400: "local_plain_wide", 1000: "local_plain", 1100: "local_plain_wide"}),
    (4096, "quant", {128: "local_quant_wide_streamed", 400: "local_quant_wide", 1000: "local_quant_wide"}),
    (7168, "quant", {101: "local_quant_split", 102: "local_quant_wide_streamed", 110: "local_quant_wide_streamed",
                     111: "local_quant_broad_held_streamed",
                     132: "local_quant_broad_held_streamed", 133: "local_quant_split", 256: "local_quant_wide",
                     300: "local_quant"}),
    # H = 5120 plain: cooperative to 0.7 rows per SM, the wide twin to one, cooperative again to 1.5.
    (5120, "plain", {92: "local_plain_split", 93: "local_plain_wide", 132: "local_plain_wide",
                     133: "local_plain_split", 198: "local_plain_split", 199: "local_plain", 256: "local_plain",
                     1000: "local_plain", 1536: "local_plain_wide", 2048: "local_plain", 4096: "local_plain_wide"}),
])
def test_local_calls_of_x_take_the_forms_of_their_measured_windows(hidden, variant, rows):
    """On 132 SMs (unhinted calls): the broad twins in ``LOCAL_X_BROAD_ROWS_PER_SM`` and
    ``LOCAL_X_HINTED_BROAD_HELD_ROWS_PER_SM`` before any other form, the parked form in
    ``LOCAL_X_PARKED_ROWS_PER_SM`` where the wide twin's window would take the call, and the wide
    twin's hinted twin in its few rows (``LOCAL_X_HINTED_WIDE_ROWS_PER_SM``).
    The finalize takes none of these windows."""
    kernels = _on_132_sms(hidden)
    assert _local_forms_of_x(kernels, variant, rows) == rows
    finalize = _chosen_kernels(kernels)
    kernels._launch_consumer(f"local_finalize_{variant}", 128, variant=variant, local=True)
    assert "_broad" not in finalize[0] and "_streamed" not in finalize[0]


@pytest.mark.parametrize("hidden,variant,rows", [
    # 7-8 rows per SM: no parked form; H = 4096 plain the wide twin, 7168 plain the broad twin.
    (4096, "plain", {924: "local_plain_wide", 1000: "local_plain_wide", 1056: "local_plain_wide"}),
    (7168, "plain", {924: "local_plain_wide", 925: "local_plain_broad", 1056: "local_plain_broad",
                     1057: "local_plain_wide"}),
    (4096, "quant", {924: "local_quant_wide", 925: "local_quant_broad_held_streamed",
                     1056: "local_quant_broad_held_streamed", 1057: "local_quant_wide"}),
    # H = 5120 plain: cooperative to 0.7 rows per SM, the wide twin to one, then parked; the wide
    # twin from 5.5 but cooperative at 12-16 (both variants).
    (5120, "plain", {92: "local_plain_split", 93: "local_plain_wide", 132: "local_plain_wide",
                     133: "local_plain", 725: "local_plain", 1000: "local_plain_wide", 1584: "local_plain_wide",
                     1585: "local_plain_split", 2112: "local_plain_split", 2113: "local_plain_wide"}),
    (5120, "quant", {198: "local_quant_split", 1584: "local_quant", 1585: "local_quant_split",
                     2112: "local_quant_split", 2113: "local_quant"}),
    # H = 4096: cooperative from 9 rows per SM (plain) and 11 (quant), to 64.
    (4096, "plain", {1188: "local_plain_wide", 1189: "local_plain_split", 8192: "local_plain_split"}),
    (4096, "quant", {1452: "local_quant_wide", 1453: "local_quant_split", 8192: "local_quant_split"}),
])
def test_an_h100_takes_the_windows_measured_on_it(hidden, variant, rows):
    """On 132 SMs of an H100, the local calls of x take the forms of its ``MODEL_WINDOWS`` where they
    replace the H200's; the rows no entry covers keep the H200's (``test_local_calls_of_x_take_...``)."""
    assert _local_forms_of_x(_on_132_sms(hidden, "h100"), variant, rows) == rows
    assert _local_forms_of_x(_on_132_sms(hidden), variant, rows) != rows  # an H200's differ at some


def test_the_broad_twin_of_x_gives_the_references_bits():
    """H = 7168 plain under the interpreter, the broad twin forced (chunks of 4096, the second masked
    past 3072), also where a call would take the hints (the broad twin has none): the bits are the
    reference's."""
    group = SimulatedGroup(1, hidden_size=7168, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, split_rows=0)
    kernels = group.paths[0].kernels["triton"]
    assert kernels.local_x_broad_windows == {"plain": (), "quant": (), "residual": ()}  # no SMs: never
    kernels.local_x_broad_windows = {variant: ((0, CAPACITY),) for variant in kernels.local_x_broad_windows}
    launched = _recording_launches(kernels)
    check_simulated(group, random_inputs(1, 3, 7168, HC, seed=3, top_k=TOP_K), "plain", EPS)
    kernels.streamed_rows, kernels.l2_bytes = (0, CAPACITY), 1
    check_simulated(group, random_inputs(1, 2, 7168, HC, seed=2, top_k=TOP_K), "plain", EPS)
    assert launched == ["local_plain_broad", "local_plain_broad"]


@pytest.mark.parametrize("hidden,variant", [(4096, "quant"), (5120, "plain")])
def test_the_broad_held_twin_of_x_gives_the_references_bits(hidden, variant):
    """The broad held twin forced under the interpreter (H = 4096: one chunk of 4096; 5120: two, the
    second masked past 1024), hinted and not: the bits are the reference's. No SMs known, its windows
    hold no call."""
    group = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=0)
    kernels = group.paths[0].kernels["triton"]
    assert not any(kernels.local_x_broad_held_windows.values()) and not any(kernels.local_x_hinted_broad_held_windows.values())
    assert kernels.plan[f"local_{variant}_broad_held"].constexprs["CHUNKS"] == hidden // 4096 + (hidden % 4096 > 0)
    launched = _recording_launches(kernels)
    kernels.local_x_broad_held_windows = {key: ((0, CAPACITY),) for key in kernels.local_x_broad_held_windows}
    check_simulated(group, random_inputs(1, 3, hidden, HC, seed=hidden + 3, top_k=TOP_K), variant, EPS)
    kernels.local_x_hinted_broad_held_windows = kernels.local_x_broad_held_windows
    check_simulated(group, random_inputs(1, 2, hidden, HC, seed=hidden + 2, top_k=TOP_K), variant, EPS)
    assert launched == [f"local_{variant}_broad_held", f"local_{variant}_broad_held_streamed"]


@pytest.mark.parametrize("hidden,form,kernel", [(2048, "cooperative", "local_quant_split"),
                                                (1024, "parked", "local_quant"), (1024, "held", "local_quant_held")])
def test_each_walk_of_the_row_zeroes_the_scales_of_the_padding_rows(hidden, form, kernel):
    """The padding rows [M, roundup(M, 128)) of the scale tile, strided over the tokens, in each of the
    three places that zero them (a program per chunk, and once a token after the parked and the held
    row): M = 1 (one token takes all 127), 63 (two tokens take two rows), 65 (a row each, the last
    two none) and 129 (in the second tile); the scales start poisoned (``SimulatedGroup``)."""
    from lamport_mhc.bench.local_forms import FormForcer

    group = SimulatedGroup(1, hidden_size=hidden, hc_mult=HC, max_num_tokens=129, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=0)
    kernels = group.paths[0].kernels["triton"]
    FormForcer(kernels).force(form, False)
    launched = _recording_launches(kernels)
    for m in (1, 63, 65, 129):
        check_simulated(group, random_inputs(1, m, hidden, HC, seed=hidden + m, top_k=TOP_K), "quant", EPS)
    assert set(launched) == {kernel}, launched


def test_local_calls_of_x_take_the_broad_held_twin_in_its_windows():
    """Calls of x in the broad held twin's windows take it before any other form (in the hinted
    windows its hinted twin, as do calls that stream past the L2); the finalize, which has no such
    twin, keeps its form."""
    kernels = _on_132_sms(4096)
    launched = _chosen_kernels(kernels)
    kernels.local_x_broad_held_windows = {"plain": ((99, 128),), "quant": (), "residual": ()}
    kernels.local_x_hinted_broad_held_windows = {"plain": (), "quant": ((99, 128),), "residual": ()}
    for m, variant, local_x, streamed in ((100, "plain", True, False), (128, "plain", True, True),
                                          (100, "quant", True, False), (129, "plain", True, False),
                                          (100, "plain", False, False)):
        kernels._launch_consumer(f"local{'' if local_x else '_finalize'}_{variant}", m, variant=variant, local=True,
                                 local_x=local_x, streamed=streamed)
    assert launched[:3] == ["local_plain_broad_held", "local_plain_broad_held_streamed", "local_quant_broad_held_streamed"]
    assert "broad_held" not in launched[3] and "broad_held" not in launched[-1]


def test_quant_calls_of_many_rows_take_the_four_chunk_wide_twin():
    """H = 7168 quant: the consumer of x walks the row in two chunks of 4096 (the second masked past
    3072) from its window on; the plain variant takes its own wide twin (chunks of 2048). The bits
    are the reference's (the interpreter takes the twins at every M)."""
    group = SimulatedGroup(1, hidden_size=7168, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                           quantize_layer_input=True, split_rows=0)
    kernels = group.paths[0].kernels["triton"]
    assert kernels.wide_rows["quant", True] == kernels.wide_rows["plain", True] == (0, 0)
    assert kernels.plan["local_plain_wide"].constexprs["CHUNK"] == 2048
    launched = _recording_launches(kernels)
    for m, variant in ((3, "quant"), (1, "plain"), (CAPACITY, "quant")):
        check_simulated(group, random_inputs(1, m, 7168, HC, seed=m, top_k=TOP_K), variant, EPS)
    assert launched == ["local_quant_wide", "local_plain_wide", "local_quant_wide"]


@pytest.mark.parametrize("hidden,capped_rows,resident,most", [(4096, 0, 100, 160), (5120, 184, 140, 190),
                                                               (7168, UNBOUNDED, 100, 170)])
def test_local_calls_of_x_take_the_capped_twin_as_measured(hidden, capped_rows, resident, most):
    """On 132 SMs the local cooperative calls of x past the uncapped form's resident clusters take
    the capped twin only from 1.4 rows per SM at H = 5120 and never at 7168 (unmeasured widths: from
    the resident clusters); the finalize's from the resident clusters."""
    kernels = _on_132_sms(hidden)
    assert kernels.local_x_capped_rows == capped_rows
    launched = _chosen_kernels(kernels)  # a cooperative call: mix, then normalize
    kernels._spreads["local_plain_split"] = (None, 0, (Spread(ctas_per_sm=8, clusters=resident, shared_bytes=0),))
    kernels._spreads["local_finalize_plain_split"] = kernels._spreads["local_plain_split"]
    rows = (resident, resident + 1, most)  # every call in a cooperative window
    for m in rows:
        kernels._launch_consumer("local_plain", m, local=True, local_x=True)
        kernels._launch_consumer("local_finalize_plain", m, local=True)
    assert launched[::4] == launched[1::4] == [
        f"local_plain_split{'_capped' if resident < m and capped_rows < m else ''}" for m in rows]
    assert launched[2::4] == launched[3::4] == ["local_finalize_plain_split"] + ["local_finalize_plain_split_capped"] * 2


def test_cooperative_calls_past_the_resident_clusters_take_the_capped_twin():
    """A local cooperative call of more tokens than the GPU holds clusters of the split kernel at
    once runs its ``_capped`` twin (fewer registers, more clusters resident); the bits are the same."""
    group = SimulatedGroup(1, hidden_size=1408, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K, split_rows=4)
    kernels = group.paths[0].kernels["triton"]
    kernels._spreads["local_plain_split"] = (None, 0, (Spread(ctas_per_sm=8, clusters=2, shared_bytes=0),))
    launched = _recording_launches(kernels)
    for m in (2, 3):
        check_simulated(group, random_inputs(1, m, 1408, HC, seed=m, top_k=TOP_K), "plain", EPS)
    assert launched == ["local_plain_split"] * 2 + ["local_plain_split_capped"] * 2  # mix, then normalize


def test_info_names_the_model_whose_windows_the_local_forms_take():
    """``python -m lamport_mhc info`` on a GPU says which windows its local forms take."""
    from kernels_triton.backend import MODEL_WINDOWS, describe_windows

    h100 = describe_windows("h100")
    assert "h100" in h100 and all(table in h100 for table in MODEL_WINDOWS["h100"])
    assert describe_windows("h200") == describe_windows("hopper") == describe_windows(None)
    assert "H200" in describe_windows(None)
