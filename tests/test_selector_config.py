"""Config, environment override, backend choice, protocol thresholds and the cross-check report."""

import pytest
import torch

from lamport_mhc import AllReduceMHCConfig, presets
from lamport_mhc.backend import BuildSpec, Support, load_backend
from lamport_mhc.selector import (Thresholds, choose_protocol, cross_check, first_difference, pick_backends,
                                  support_table)


@pytest.mark.parametrize("kwargs,message", [
    (dict(backend="cuda"), "backend must be one of"),
    (dict(transport="nvls"), "transport must be one of"),
    (dict(bt_min_rows=0), "bt_min_rows must be a positive int"),
    (dict(bt_min_finalize_rows=2.5), "bt_min_finalize_rows must be a positive int"),
    (dict(spin_timeout_ms=0), "spin_timeout_ms must be a positive finite"),
    (dict(spin_timeout_ms=float("inf")), "spin_timeout_ms must be a positive finite"),
    (dict(cross_check_backend="auto"), "cross_check_backend must be one of"),
])
def test_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AllReduceMHCConfig(**kwargs)


def test_environment_overrides_the_backend(monkeypatch):
    config = AllReduceMHCConfig(backend="triton", spin_timeout_ms=1.5)
    monkeypatch.delenv("LAMPORT_MHC_BACKEND", raising=False)
    assert config.with_environment().backend == "triton"
    monkeypatch.setenv("LAMPORT_MHC_BACKEND", "torch")
    assert config.with_environment().backend == "torch"
    assert config.spin_timeout_ns == 1_500_000
    monkeypatch.setenv("LAMPORT_MHC_BACKEND", "fast")
    with pytest.raises(ValueError, match="LAMPORT_MHC_BACKEND='fast'"):
        config.with_environment()


def test_pick_backends():
    preset = presets.Preset(1, 1, ("triton", "cute"), "test")
    assert pick_backends("auto", preset, {"cute", "triton"}) == ("triton",)
    assert pick_backends("auto", preset, {"cute"}) == ("cute",)
    assert pick_backends("auto", preset, set()) == ("torch",)
    assert pick_backends("torch", preset, {"triton"}) == ("torch",)
    assert pick_backends("cute", preset, {"cute", "triton"}) == ("cute",)
    with pytest.raises(RuntimeError, match="'triton' is not supported on every rank"):
        pick_backends("triton", preset, {"cute"})


def test_auto_builds_every_routed_backend_only_where_all_run():
    routed = presets.Preset(1, 1, ("cute", "triton"), "test",
                            routes={"plain": ((128, "cute"), (256, "triton"), (8192, "cute")),
                                    "quant": ((8192, "cute"),)})
    assert routed.routed_backends() == ("cute", "triton")
    assert pick_backends("auto", routed, {"cute", "triton"}) == ("cute", "triton")
    assert pick_backends("auto", routed, {"triton"}) == ("triton",)  # the preference, not half a route
    assert [routed.backend_for("plain", m) for m in (1, 128, 129, 256, 257, 10**6)] == \
        ["cute", "cute", "triton", "triton", "cute", "cute"]
    assert routed.backend_for("quant", 200) == "cute" and routed.backend_for("finalize", 5) is None


def test_measured_presets_are_what_their_results_file_gives():
    """Every PRESETS row is the derivation of the CSV it names (rerun ``python -m lamport_mhc presets``
    after a new benchmark)."""
    import csv
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for (family, tp, hidden), preset in presets.PRESETS.items():
        with open(root / preset.source, newline="") as f:
            rows = list(csv.DictReader(f))
        assert presets.derive(rows, tp, hidden, preset.source) == preset, (family, tp, hidden)


def test_choose_protocol():
    thresholds = Thresholds(bt_min_rows=37, bt_min_finalize_rows=43)
    both = ("ll", "bt")
    assert choose_protocol("plain", 36, thresholds, both) == "ll"
    assert choose_protocol("plain", 37, thresholds, both) == "bt"
    assert choose_protocol("finalize", 42, thresholds, both) == "ll"
    assert choose_protocol("finalize", 43, thresholds, both) == "bt"
    assert choose_protocol("plain", 4096, thresholds, ("ll",)) == "ll"  # no BT state built
    assert choose_protocol("finalize", 4096, thresholds, ("local",)) == "local"  # a group of one


def test_support_on_a_cpu_machine_says_why():
    spec = BuildSpec(hidden=256, hc=4, capacity=8, top_k=2, tp=2, rank=0)
    table = support_table(spec, torch.device("cpu"))
    assert not table["triton"].ok and "SimulatedGroup" in table["triton"].reason
    assert not table["cute"].ok and table["cute"].reason
    cute = load_backend("cute")  # a Support without nvidia-cutlass-dsl, else a backend that says no here
    assert isinstance(cute, Support) or not cute.support(spec, torch.device("cpu")).ok
    with pytest.raises(ValueError, match="unknown fused backend"):
        load_backend("torch")


def test_first_difference_names_output_and_index():
    a = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    b = a.clone()
    assert first_difference("residual_out", a, b) is None
    b[1, 2, 3] = -0.0  # a sign bit is a difference
    assert first_difference("residual_out", a, b) == "residual_out differs first at index (1, 2, 3): 0x0 vs 0xffff8000"
    with pytest.raises(RuntimeError, match=r"cross-check triton vs torch: layer_input differs first at index \(1, 2, 3\)"):
        cross_check("triton", "torch", {"layer_input": a}, {"layer_input": b})


def test_presets_fall_back_with_their_source():
    preset = presets.lookup("hopper", 2, 5120)
    assert preset.bt_min_rows >= 1 and preset.source
    assert presets.gpu_family((9, 0)) == "hopper" and presets.gpu_family(None) == "cpu"
