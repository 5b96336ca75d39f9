"""Where the kernels run: compiled on a GPU, or under Triton's CPU interpreter.

``TRITON_INTERPRET=1`` (set by the tests and by CPU ranks) makes every Triton
launch run its programs one after another on the CPU. The interpreter cannot
let programs wait for each other, run inline assembly or multiply bf16 tiles
correctly, so code that launches kernels asks :func:`interpreting` and takes
its CPU path (phased megakernel, fp32 dots, software E4M3 rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton import knobs

#: Default poll budgets of an in-kernel wait. A poll is one acquire load of a local flag or counter: about a
#: microsecond compiled (2**24 polls: seconds), far slower under the interpreter, where a peer process may also
#: take seconds to arrive.
DEFAULT_WAIT_BUDGET = 1 << 24
DEFAULT_WAIT_BUDGET_INTERPRETED = 1 << 20
#: A host-launched barrier's (a pass's start and end, ``device_barrier``) when none is given: it waits for the
#: peers' host, which on a first pass may be compiling kernels this rank does not need (the shared expert's tiles
#: follow the rank's own token count; a rank without tokens launches none): tens of seconds. At 2**24 polls the GPU
#: soak's rank without tokens timed out while its peer compiled (one H200, 2026-12-06); 2**28 polls: minutes.
DEFAULT_BARRIER_WAIT_BUDGET = 1 << 28

#: Programs of a persistent launch under the interpreter (it runs them one by one: a few cover every role).
INTERPRETER_PROGRAMS = 4


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter: ``TRITON_INTERPRET`` read by Triton's own rule
    (1, true, on, yes), so this agrees with what a launch does."""
    return bool(knobs.runtime.interpret)


def compiled_gpu(device: torch.device) -> bool:
    """True when kernels on ``device`` run compiled on a CUDA GPU (not the interpreter)."""
    return device.type == "cuda" and not interpreting()


def num_programs(device: torch.device, requested: int | None = None) -> int:
    """Programs of a persistent launch: ``requested``, else the GPU's SM count (4 under the interpreter)."""
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ValueError(f"num_programs must be a positive int, got {requested!r}")
        return requested
    if compiled_gpu(device):
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def env_switch(name: str, default: bool) -> bool:
    """A 0/1 environment switch (an A/B knob read at import): ``default`` when unset; ValueError naming it for any
    other value (a typo must not silently leave a default in place)."""
    text = os.environ.get(name)
    if text is None:
        return default
    if text.strip() not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text.strip() == "1"


def env_ratio(name: str, default: float) -> float:
    """A non-negative number from the environment (an A/B knob read at import; ``inf`` allowed): ``default`` when
    unset; ValueError naming it for anything else (a typo must not silently leave a default in place)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # NaN too
        raise ValueError(f"{name} must be a number >= 0 (or inf), got {text!r}")
    return value


def retired_knob(name: str, instead: str) -> None:
    """ValueError naming ``instead`` when the environment still sets ``name``, a knob that is gone (read at import:
    a run that set it must not silently measure something else)."""
    if name in os.environ:
        raise ValueError(f"{name} is gone: {instead}")


def resolve_wait_budget(budget: object = None, *, barrier: bool = False) -> int:
    """An in-kernel wait's poll budget: ``budget`` (an int in [1, 2**31)), else ``MEGAMOE_WAIT_BUDGET``, else the
    default for where kernels run (``barrier``: a host-launched barrier's, ``DEFAULT_BARRIER_WAIT_BUDGET``)."""
    if budget is None:
        text = os.environ.get("MEGAMOE_WAIT_BUDGET")
        if text is None:
            if interpreting():
                return DEFAULT_WAIT_BUDGET_INTERPRETED
            return DEFAULT_BARRIER_WAIT_BUDGET if barrier else DEFAULT_WAIT_BUDGET
        budget = int(text) if text.strip().isdigit() else text
        where = "MEGAMOE_WAIT_BUDGET"
    else:
        where = "wait_budget"
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < 2**31:
        raise ValueError(f"{where} must be an int in [1, 2**31), got {budget!r}")
    return budget


def _index_of_interpreted(self) -> int:
    return int(self.handle.data.item())


def _patch_language_once_per_launch() -> None:
    """Make Triton 3.6's interpreter patch ``triton.language`` once per launch, not once per device-function call.

    A launch patches the language modules its kernel sees (``inspect.getmembers`` over ``tl``, ``tl.tensor``,
    ``tl.math``: ~0.7 ms) and restores them when it ends; every ``@triton.jit`` helper call inside it patches them
    again, with the same builder, and drops that scope unrestored. Those repeats were a third of a CPU training
    step. Here a helper call whose language modules the running launch has patched already is not patched again,
    and a launch's tensors index with their one element (not int() of a 1-element array, which newer NumPy
    refuses). Other Triton versions are left as they are."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if not triton.__version__.startswith("3.6.") or original is None or getattr(original, "_megamoe", False):
        return
    patched: set[int] = set()  # the language modules the running launch has patched
    langs_of: dict = {}  # function -> ids of the language modules in its globals (as _patch_lang finds them)

    class Unpatched:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if patched and langs <= patched:
            return Unpatched()
        launch = not patched
        scope = original(fn)
        patched.update(langs)
        # Triton 3.6 indexes with int(data) of a 1-element array (a scalar load from a pointer argument):
        # deprecated since NumPy 1.25, an error in later NumPy. The launch scope's restore puts the original back.
        tl.core.tensor.__index__ = _index_of_interpreted
        if launch:  # the launch's own scope: its restore ends the launch
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()
            scope.restore = restore_and_forget
        return scope

    patch_lang._megamoe = True
    interpreter._patch_lang = patch_lang


def _interpret_integer_arithmetic_as_compiled() -> None:
    """Turn off Triton 3.6's interpreter-only integer overflow check (``InterpreterOptions.sanitize_overflow``).

    The interpreter redoes every int32 add, sub and mul in int64 to assert that the result fits, but outside
    debug mode its assert does not raise: an overflow wraps either way, as in a compiled kernel. The dead
    checks took ~37 % of a CPU training step (cProfile of test_training's one-rank cases: 13.8 of 36.7 s;
    that test 16.5 -> 12.6 s without them). Other Triton versions are left as they are."""
    from dataclasses import replace

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if not triton.__version__.startswith("3.6.") or not getattr(getattr(builder, "options", None),
                                                                 "sanitize_overflow", False):
        return
    builder.options = replace(builder.options, sanitize_overflow=False)


_patch_language_once_per_launch()
_interpret_integer_arithmetic_as_compiled()
