"""Test setup: Triton kernels run under the interpreter when there is no GPU; GPU tests time out by a thread."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if "gpu" in item.keywords]
    if torch.cuda.is_available():
        # A kernel that never finishes (a deadlocked barrier wait) blocks the test in C, where pytest-timeout's
        # signal method cannot interrupt it: GPU tests time out by its thread method (every thread's stack
        # dumped, the run ended) after the same `timeout` as the rest.
        for item in gpu_tests:
            item.add_marker(pytest.mark.timeout(method="thread"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_tests:
        item.add_marker(skip)
