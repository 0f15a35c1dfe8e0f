"""Shared fixtures: seeding, the `gpu` marker, tiny Hugging Face checkpoints."""

from __future__ import annotations

import random

import pytest
import torch

from tests import tiny_models


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seed():
    random.seed(0)
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{family case: (directory, transformers model)} saved as sharded safetensors."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: tiny_models.save(name, root / name) for name in tiny_models.CASES}
