"""The spin bound on the host side, on CPU: a kernel that gave up leaves its record in the host
mirror (flag last), an eager call raises from it without a device copy, a call made while a CUDA
graph is being captured looks at nothing, and once raised the instance stays unusable.

The op is an ``AllReduceMHC`` over rank 0 of a simulated group of two (the Triton kernels under the
interpreter), so the real call path runs: ``_ready``, validation, the fused path, the kernels; rank 1
publishes before and consumes after each of its calls."""

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from lamport_mhc import SimulatedGroup, api, layout, validate
from lamport_mhc.api import AllReduceMHC
from lamport_mhc.config import AllReduceMHCConfig
from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs
from lamport_mhc.workspace import Workspace

H, HC, CAP, TOP_K, EPS = 128, 4, 4, 2, 1e-6
TIMEOUT = r"triton rank 0: spin timeout waiting for rank 0's contribution to token 0 of generation {}"


def _op(spin_timeout_ms=50.0) -> AllReduceMHC:
    """An AllReduceMHC whose path is rank 0's of a simulated group of two: the fused path over host
    memory (LL in two kernels)."""
    group = SimulatedGroup(2, hidden_size=H, hc_mult=HC, max_num_tokens=CAP, top_k=TOP_K, ll_one_kernel_rows=0)
    op = AllReduceMHC.__new__(AllReduceMHC)
    op.config = AllReduceMHCConfig(backend="triton", spin_timeout_ms=spin_timeout_ms)
    op.spec = replace(group.specs[0], spin_timeout_ns=op.config.spin_timeout_ns)
    op.device, op.path, op.check_path, op._broken = torch.device("cpu"), group.paths[0], None, None
    op.backend = op.path.name = "triton"
    op.peer = group.paths[1], group.specs[1]
    return op


def _call(op, seed):
    inputs = random_inputs(2, 2, H, HC, seed=seed)
    consumer = (inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS)
    peer_path, peer_spec = op.peer
    peer_call = validate.plain_call(peer_spec, op.device, inputs["xs"][1], *consumer, None)
    peer_path.publish(peer_call, "ll")
    out = op(inputs["xs"][0], *consumer)
    peer_path.consume(peer_call, "ll")
    assert_outputs_match((out[0], out[1], None), expected_outputs(inputs, "plain", EPS))


def _consume_unpublished(op) -> int:
    """Launch the consumer over a generation no publish wrote; returns that generation."""
    inputs = random_inputs(2, 2, H, HC, seed=99)
    call = validate.plain_call(op.spec, op.device, inputs["xs"][0], inputs["residual"], inputs["post"],
                               inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS, None)
    generation = int(op.path.workspace.ll_state[layout.STATE_ACTIVE])
    op.path.consume(call, "ll")
    return generation


def test_a_timed_out_poll_leaves_its_record_in_the_mirror_and_the_device_buffer():
    op = _op()
    _call(op, 0)
    _call(op, 1)
    ws = op.path.workspace
    assert ws.error_mirror.tolist() == [0, 0, 0, 0]
    generation = _consume_unpublished(op)
    assert generation == 1
    assert ws.error_mirror.tolist() == [1, 0, generation, 0]  # flag, source, generation, token
    assert ws.error[:layout.RECORD_WORDS].tolist() == [1, 0, generation, 0]  # the claimed device record
    assert ws.error.view(torch.int64)[layout.ERROR_MIRROR_ADDRESS] == ws.error_mirror.data_ptr()  # untouched


def test_a_call_during_capture_reads_nothing_and_the_next_eager_call_raises(monkeypatch):
    op = _op()
    _call(op, 0)
    generation = _consume_unpublished(op)

    def no_read(self):
        raise AssertionError("the error record was read during graph capture")

    with monkeypatch.context() as capture:
        capture.setattr(api, "stream_capturing", lambda device: True)
        capture.setattr(Workspace, "read_error", no_read)
        capture.setattr(torch.Tensor, "tolist", lambda self: no_read(self))  # no copy of any buffer either
        _call(op, 1)  # captured: runs, and its outputs are right
    with pytest.raises(RuntimeError, match=TIMEOUT.format(generation)) as raised:
        _call(op, 2)
    for _ in range(2):  # unusable until rebuilt, whatever is asked
        with pytest.raises(RuntimeError, match=str(raised.value)[:60]):
            _call(op, 3)
        with pytest.raises(RuntimeError, match=TIMEOUT.format(generation)):
            op.check()


def test_an_eager_call_reads_only_the_host_mirror():
    """The eager check is a host read of the mirror: no copy of the device buffer (here made
    unreadable after the kernels ran) and no synchronization."""
    op = _op()
    _consume_unpublished(op)
    op.path.workspace.error = torch.empty(layout.ERROR_WORDS, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match=TIMEOUT.format(0)):
        op._ready()


def test_without_the_bound_no_call_looks(monkeypatch):
    op = _op(spin_timeout_ms=None)
    monkeypatch.setattr(Workspace, "read_error", lambda self: pytest.fail("read without the spin bound"))
    _call(op, 0)


def test_stream_capturing_asks_the_device_of_the_op(monkeypatch):
    entered = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device) or nullcontext())
    assert api.stream_capturing(torch.device("cuda", 0)) and entered == []
    assert api.stream_capturing(torch.device("cuda", 1)) and entered == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("asked on a CPU op"))
    assert not api.stream_capturing(torch.device("cpu"))
