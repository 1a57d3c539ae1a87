"""lamport_mhc.machine: the machine probe, the multicast switch and the description lines."""

import dataclasses
import importlib.metadata
import sys

import pytest
import torch

from lamport_mhc import machine
from lamport_mhc.machine import (
    MULTICAST_ENV,
    MachineInfo,
    describe,
    multicast_allowed,
    multicast_disabled_by_env,
    probe,
)


@pytest.fixture(autouse=True)
def _fresh_probe():
    probe.cache_clear()
    yield
    probe.cache_clear()


def _info(**overrides):
    base = dict(gpus=("NVIDIA H200", "NVIDIA H200"), capability=(9, 0), peer_access=True,
                multicast_disabled_by_env=True, symmetric_memory=True, triton_version="3.6.0",
                cute_dsl_version="4.3.0", flashinfer_version="0.7.2", torch_version="2.11.0+cu130")
    base.update(overrides)
    return MachineInfo(**base)


def test_probe_works_here_and_is_cached():
    info = probe()
    assert isinstance(info, MachineInfo)
    assert probe() is info
    assert info.torch_version == torch.__version__
    assert isinstance(info.gpus, tuple) and all(isinstance(n, str) for n in info.gpus)
    if torch.cuda.is_available():
        assert len(info.gpus) == torch.cuda.device_count()
        assert info.capability == tuple(torch.cuda.get_device_capability(0))
    else:
        assert info.gpus == ()
        assert info.capability is None
        assert info.peer_access is True
    assert isinstance(info.symmetric_memory, bool)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.peer_access = False


def test_probe_versions_come_from_distribution_metadata():
    info = probe()
    assert info.triton_version == importlib.metadata.version("triton")
    for attr, dist in (("cute_dsl_version", "nvidia-cutlass-dsl"),
                       ("flashinfer_version", "flashinfer-python")):
        try:
            expected = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            expected = None
        assert getattr(info, attr) == expected


def test_probe_imports_no_optional_backend():
    before = set(sys.modules)
    probe()
    new = set(sys.modules) - before
    assert not any(m == "cutlass" or m.startswith("cutlass.") for m in new)
    assert not any(m == "flashinfer" or m.startswith("flashinfer.") for m in new)


def test_probe_creates_no_symmetric_memory(monkeypatch):
    symm_mem = pytest.importorskip("torch.distributed._symmetric_memory")

    def forbidden(*args, **kwargs):
        raise AssertionError("probe() must not allocate or rendezvous symmetric memory")

    for name in ("empty", "rendezvous"):
        if hasattr(symm_mem, name):
            monkeypatch.setattr(symm_mem, name, forbidden)
    assert probe().symmetric_memory is True


def test_probe_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = probe()
    assert (info.gpus, info.capability, info.peer_access) == ((), None, True)


@pytest.mark.parametrize("value, disabled", [
    (None, False), ("", False), ("0", False), ("false", False), ("Off", False),
    ("1", True), ("true", True), ("YES", True), ("on", True), ("2", True),
])
def test_multicast_env_switch(monkeypatch, value, disabled):
    if value is None:
        monkeypatch.delenv(MULTICAST_ENV, raising=False)
    else:
        monkeypatch.setenv(MULTICAST_ENV, value)
    assert multicast_disabled_by_env() is disabled
    assert multicast_allowed() is (not disabled)
    assert probe().multicast_disabled_by_env is disabled


def test_multicast_allowed_reads_the_environment_now(monkeypatch):
    monkeypatch.delenv(MULTICAST_ENV, raising=False)
    assert probe().multicast_disabled_by_env is False
    monkeypatch.setenv(MULTICAST_ENV, "1")
    assert multicast_allowed() is False
    # The snapshot keeps what it saw until the cache is cleared.
    assert probe().multicast_disabled_by_env is False
    probe.cache_clear()
    assert probe().multicast_disabled_by_env is True


def test_describe_this_machine():
    lines = describe(probe())
    assert lines and all(isinstance(line, str) and line for line in lines)
    text = "\n".join(lines)
    assert torch.__version__ in text
    assert "multicast" in text and "triton" in text and "CuTe DSL" in text


def test_describe_two_gpus_with_and_without_peer_access():
    text = "\n".join(describe(_info()))
    assert "GPU 0: NVIDIA H200" in text and "GPU 1: NVIDIA H200" in text
    assert "sm_90" in text
    assert "peer access: yes" in text
    assert f"disabled by {MULTICAST_ENV}" in text
    assert "4.3.0" in text and "0.7.2" in text

    text = "\n".join(describe(_info(peer_access=False, multicast_disabled_by_env=False,
                                    cute_dsl_version=None)))
    assert "peer access: NO" in text
    assert "multicast: allowed" in text
    assert "CuTe DSL (nvidia-cutlass-dsl): not installed" in text


def test_describe_without_gpus():
    text = "\n".join(describe(_info(gpus=(), capability=None, symmetric_memory=False)))
    assert "GPUs: none" in text
    assert "capability" not in text
    assert "symmetric memory: not available" in text


def test_module_exports():
    for name in machine.__all__:
        assert hasattr(machine, name)


def test_versions_are_called_tested_where_a_tier_passed_on_them():
    from lamport_mhc.machine import tested

    assert tested("torch", "2.13.0+cpu") == "2.13.0+cpu (tested: CPU tiers)"
    assert tested("nvidia-cutlass-dsl", "4.8.0") == "4.8.0 (tested: CuTe compile tier)"
    assert tested("triton", "3.7.1").startswith("3.7.1 (not a tested version; tested: 3.6.0, 3.8.0")
    assert tested("flashinfer-python", None) == "not installed"
