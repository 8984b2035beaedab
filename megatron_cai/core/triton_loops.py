"""Loop bounds of our Triton kernels that work both compiled and under the Triton interpreter.

A runtime loop bound (a kernel argument, a loaded count) is a 1-element array under the interpreter.
triton 3.6.0's interpreter turns a ``range`` bound into a Python int with ``int(ndarray)``, which
numpy >= 2.4 refuses for arrays of one dimension ("only 0-dimensional arrays can be converted to Python
scalars"); newer Triton squeezes the array first. Every runtime ``range`` bound in a kernel goes
through :func:`loop_bound`: compiled, it is the value itself (the loop stays a pipelined ``scf.for``;
the interpreter branch is a constexpr ``if`` that is never compiled), interpreted, a Python int.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Read when the kernels are defined, as Triton decides between compiling and interpreting them.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def loop_bound(x):
    """``x`` as a ``range`` bound (see the module docstring)."""
    if INTERPRETED:
        return x.handle.data.item()
    return x
