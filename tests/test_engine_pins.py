"""The check that the project installs beside the engines (tests/engine_pins.py, run by .ci/run):
its verdicts, on resolutions made up here (the live one needs the package index)."""

import engine_pins

VLLM = {"vllm": "0.33.0", "torch": "2.14.0", "nvidia-cutlass-dsl": "4.8.0", "numpy": "2.3.5"}


def test_an_install_that_keeps_every_pin_passes():
    together = {**VLLM, "lamport-mhc": "0.1.0", "cuda-python": "13.4.4"}
    assert engine_pins.moved_pins(VLLM, together) == []


def test_a_moved_or_dropped_pin_is_named():
    together = {**VLLM, "nvidia-cutlass-dsl": "4.8.1"}
    del together["numpy"]
    assert engine_pins.moved_pins(VLLM, together) == ["numpy: 2.3.5 -> not installed",
                                                      "nvidia-cutlass-dsl: 4.8.0 -> 4.8.1"]


def test_a_conflict_fails_the_check(monkeypatch, capsys):
    def resolve(requirements):
        if len(requirements) > 1:
            raise RuntimeError("pip cannot install them together: ResolutionImpossible")
        return dict(VLLM)

    monkeypatch.setattr(engine_pins, "resolve", resolve)
    assert engine_pins.main(["vllm==0.33.0", "--project", "nvidia-cutlass-dsl[cu13]==4.8.1"]) == 1
    assert "ResolutionImpossible" in capsys.readouterr().out

