"""Shared fixtures: tiny offline pipelines (never a Hub call) and comparison helpers."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from .references import FLUX_CONFIGS  # noqa: E402


@pytest.fixture(params=sorted(FLUX_CONFIGS))
def flux_name(request):
    return request.param


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """Tiny models run on one intra-op thread: on a shared 2-core CPU, waking a second thread for a 32-wide
    matmul costs a scheduler quantum (~15 ms) while the matmul itself takes ~0.05 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served():
    """The default served model (the toy), for one test module."""
    from diffusers_stepbatch.serve import ServeConfig, load_model

    model = load_model(ServeConfig(max_batch_size=8))
    yield model
    model.close()


@pytest.fixture(scope="module")
def base_url(served):
    """A server around `served` on a free loopback port, for one test module."""
    from diffusers_stepbatch.serve import ServeConfig, create_app

    from .serve_helpers import ServerThread

    with ServerThread(create_app(ServeConfig(), model=served)) as url:
        yield url


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of the modules that share the local Ray instance (tests/ray_helpers.py), stop it."""
    yield
    if getattr(item.module, "USES_LOCAL_RAY", False) and not getattr(getattr(nextitem, "module", None),
                                                                     "USES_LOCAL_RAY", False):
        from .ray_helpers import stop_local_ray_serve

        stop_local_ray_serve()
