"""Test setup: without a GPU the Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton decorates the kernels, so before `kda` is imported.

`--plan-device sm_80` plans every call on the GPU as an A100's (`kda.plan.plan_as`: no TMA, no walk beside the
prepare, no PDL, 163 KiB of shared memory a block; the SM count the GPU's own), so that the H200 runs the suite
under the plan an sm_80 device gets (docs/platforms.md). Tests of what only sm_90 and later are planned
(`hopper_plan`) are then skipped; subprocesses (the examples, `test_gpu`'s launch-blocking run) plan for the GPU
itself."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from kda.plan import PLAN_DEVICES  # noqa: E402  (after TRITON_INTERPRET: what `--plan-device NAME` plans as)


def pytest_addoption(parser):
    parser.addoption("--plan-device", choices=sorted(PLAN_DEVICES), default=None,
                     help="plan every call on the GPU as this device's (kda.plan.plan_as): sm_80 is an A100's plan "
                          "(no TMA, no walk beside the prepare, no PDL, 163 KiB of shared memory) on the GPU at hand")


def pytest_configure(config):
    name = config.getoption("--plan-device")
    if name is None:
        return
    if not torch.cuda.is_available():
        raise pytest.UsageError("--plan-device needs a CUDA device: the interpreter is planned as itself")
    from kda.plan import plan_as

    plan_as(*PLAN_DEVICES[name])


def pytest_unconfigure(config):
    if config.getoption("--plan-device") is not None and torch.cuda.is_available():
        from kda.plan import plan_as

        plan_as()


def pytest_report_header(config):
    name = config.getoption("--plan-device")
    if name is None:
        return None
    capability, smem = PLAN_DEVICES[name]
    return (f"plan device: {name} (kda.plan.plan_as: capability {capability[0]}.{capability[1]}, {smem} bytes of "
            "shared memory a block, the GPU's own SM count)")


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Hand each test's cached blocks back: a dozen xdist workers each keeping its peak fill an 80 GB card."""
    yield
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; runs in scripts/gpu_suite.sh on the GPU machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    from kda.plan import device_info

    planned = device_info(torch.cuda.current_device())
    if planned.spin:
        return
    skip = pytest.mark.skip(reason=f"needs the plan of sm_90 or later; the GPU is planned as capability "
                                   f"{planned.capability} (no TMA, no walk beside the prepare)")
    for item in items:
        if "hopper_plan" in item.keywords:
            item.add_marker(skip)
