"""Test setup: without a GPU the Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton decorates the kernels, so before `kda` is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; runs in scripts/gpu_suite.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
