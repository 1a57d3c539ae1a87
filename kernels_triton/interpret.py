"""Run Triton kernels compiled for the GPU under the Triton interpreter, in the same process.

``@triton.jit`` picks compiling or interpreting once, at import (``TRITON_INTERPRET``). This library
needs both at once: the simulated TP group interprets the kernels on host buffers while the ``ptx``
command and the GPU path compile the very same functions. ``launch_interpreted`` runs a kernel's
Python body with the interpreter; while it runs, calls to other ``@triton.jit`` functions (this
package's helpers and Triton's own, such as ``tl.sum``), which only the compiler may otherwise
make, are interpreted too.
"""

from __future__ import annotations

import threading

import numpy as np
from contextlib import contextmanager

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_interpreted: dict[object, InterpretedFunction] = {}
_lock = threading.Lock()


def _as_interpreted(function: JITFunction) -> InterpretedFunction:
    if function.fn not in _interpreted:
        _interpreted[function.fn] = InterpretedFunction(function.fn)
    return _interpreted[function.fn]


@contextmanager
def _device_calls_interpreted():
    original = JITFunction.__call__
    JITFunction.__call__ = lambda self, *args, **kwargs: _as_interpreted(self)(*args, **kwargs)
    try:
        yield
    finally:
        JITFunction.__call__ = original


def launch_interpreted(kernel: JITFunction, grid, *args, **kwargs) -> None:
    # IEEE overflow, NaN and Inf are part of the contract, not accidents: numpy need not warn.
    with _lock, _device_calls_interpreted(), np.errstate(all="ignore"):
        _as_interpreted(kernel)[grid](*args, **kwargs)
