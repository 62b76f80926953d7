"""Shared fixtures: tiny offline pipelines (never a Hub call) and comparison helpers."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from .references import FLUX_CONFIGS  # noqa: E402


@pytest.fixture(params=sorted(FLUX_CONFIGS))
def flux_name(request):
    return request.param
