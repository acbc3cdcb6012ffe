import os
import warnings

import pytest
import torch

from eagletree.target import TargetError
from helpers import tiny_model

# The real model's de-quantized cache lives outside the repo and survives between test runs.
os.environ.setdefault("EAGLETREE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "eagletree"))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32, CPU), loaded once per test session."""
    from eagletree.target import load_target

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return load_target("smollm2-135m", dtype=torch.float32, device="cpu")
        except TargetError as e:  # a missing package is a set-up error, never a skip
            pytest.fail(f"the real model is required: {e}")
