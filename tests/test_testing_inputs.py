"""The GPU suites rebuild every rank's inputs from a seed in each process: the inputs must be the same
bits whatever the process and its thread count."""

import torch

from lamport_mhc.testing import random_inputs


def _flat_bits(inputs):
    out = []
    for value in inputs.values():
        for t in value if isinstance(value, list) else [value]:
            out.append(t.contiguous().view(torch.uint8).flatten())
    return torch.cat(out)


def test_inputs_do_not_depend_on_threads():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = _flat_bits(random_inputs(2, 256, 1024, 4, seed=7, top_k=6))
        torch.set_num_threads(max(2, threads))
        parallel = _flat_bits(random_inputs(2, 256, 1024, 4, seed=7, top_k=6))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)


def test_inputs_hold_the_edge_cases():
    inputs = random_inputs(2, 64, 512, 4, seed=1, top_k=6)
    x = inputs["xs"][0].view(torch.int16)
    assert (x == -32768).any()                       # -0.0
    assert ((x & 0x7F80) == 0).logical_and((x & 0x7F) != 0).any()  # subnormals
    assert (inputs["xs"][1].float().abs() > 1e38).any()  # huge
    assert (inputs["xs"][0][0] == 0).all() and (inputs["idxs"][0][0] == -1).all()  # the zero row
    assert (inputs["idxs"][1] == -1).any()
