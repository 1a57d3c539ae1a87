"""Run Triton kernels compiled for the GPU under the Triton interpreter, in the same process.

``@triton.jit`` picks compiling or interpreting once, at import (``TRITON_INTERPRET``). This library
needs both at once: the simulated TP group interprets the kernels on host buffers while the ``ptx``
command and the GPU path compile the very same functions. ``launch_interpreted`` runs a kernel's
Python body with the interpreter; while it runs, calls to other ``@triton.jit`` functions (this
package's helpers and Triton's own, such as ``tl.sum``), which only the compiler may otherwise
make, run their interpreted bodies too.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

_interpreted: dict[object, InterpretedFunction] = {}
_lock = threading.Lock()


def _as_interpreted(function: JITFunction) -> InterpretedFunction:
    if function.fn not in _interpreted:
        _interpreted[function.fn] = InterpretedFunction(function.fn)
    return _interpreted[function.fn]


@contextmanager
def _device_calls_interpreted(kernel: JITFunction):
    # The language is patched once for the whole launch (the kernel's ``tl`` and the ``core`` that
    # Triton's own jit functions use), not on every device call as the interpreter would: that
    # re-patching dominated the simulated group's run time.
    scopes = [_patch_lang(kernel.fn), _patch_lang(tl.standard.zeros.fn)]
    original = JITFunction.__call__
    JITFunction.__call__ = lambda self, *args, **kwargs: _as_interpreted(self).rewrite()(*args, **kwargs)
    try:
        yield
    finally:
        JITFunction.__call__ = original
        for scope in reversed(scopes):
            scope.restore()


def launch_interpreted(kernel: JITFunction, grid, *args, **kwargs) -> None:
    # IEEE overflow, NaN and Inf are part of the contract, not accidents: numpy need not warn.
    with _lock, _device_calls_interpreted(kernel), np.errstate(all="ignore"):
        _as_interpreted(kernel)[grid](*args, **kwargs)
