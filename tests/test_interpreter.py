"""megamoe.runtime's interpreter patch: the language is patched once per launch, not once per helper call."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import megamoe.runtime  # noqa: F401  (installs the patch)
from megamoe.runtime import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the CPU interpreter's path")


@triton.jit
def _scaled(x, k):
    return x * k


@triton.jit
def _twice(x):
    return _scaled(x, 2.0) + _scaled(x, 0.0)


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, calls, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs)
    for _ in range(calls):
        acc = _twice(acc)
    tl.store(out_ptr + offs, acc)


def _run(calls: int) -> torch.Tensor:
    x = torch.randn(64)
    out = torch.full_like(x, float("nan"))
    _helpers_kernel[(4,)](x, out, calls, BLOCK=16)
    return x, out


def test_nested_helpers_give_the_kernels_values_and_the_language_is_restored():
    load, store = tl.load, tl.store
    x, out = _run(3)
    assert torch.equal(out, x * 8)
    assert tl.load is load and tl.store is store  # nothing left patched after the launch
    x, out = _run(0)
    assert torch.equal(out, x)


def test_helper_calls_do_not_patch_the_language_again(monkeypatch):
    scans = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (scans.append(1), original(*a))[1])
    _run(1)
    one = len(scans)
    scans.clear()
    _run(6)  # 12 more helper calls per program
    assert one > 0 and len(scans) == one


@triton.jit
def _int32_sum_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(a_ptr + offs) + tl.load(b_ptr + offs))


def test_int32_arithmetic_wraps_as_compiled_code_does():
    """The interpreter's int32 add wraps, as a compiled (non-debug) kernel's does, and its overflow check is off:
    outside debug mode it never raised, and it took a third of a CPU training step."""
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    a = torch.tensor([2**31 - 1, -(2**31), 5, -7], dtype=torch.int32)
    b = torch.tensor([1, -1, 6, 2**31 - 1], dtype=torch.int32)
    out = torch.empty_like(a)
    _int32_sum_kernel[(1,)](a, b, out, BLOCK=4)
    assert torch.equal(out, a + b), (out, a + b)  # torch's int32 add wraps too


@triton.jit
def _loop_to_loaded_count_kernel(count_ptr, out_ptr):
    acc = 0
    for i in range(0, tl.load(count_ptr)):  # a loop bound loaded from a pointer argument, as the row tasks' are
        acc += i
    tl.store(out_ptr, acc)


def test_a_loop_to_a_loaded_count_runs_where_numpy_refuses_int_of_1_element_arrays():
    """A scalar loaded from a pointer argument is a 1-element array under the interpreter; Triton 3.6 turns it into
    a loop bound with int(array), which NumPy deprecated in 1.25 and later versions refuse (a GPU machine's NumPy
    failed every interpreted launch with it). The patch indexes with the element; nothing is left patched."""
    import warnings

    count = torch.tensor([5], dtype=torch.int32)
    out = torch.full((1,), -1, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _loop_to_loaded_count_kernel[(1,)](count, out)
    assert int(out) == 10
    assert not hasattr(tl.core.tensor, "__index__")
