"""Fixtures of the trainer tests: a gloo process group of one rank, the tiny character tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gcore_rl.distributed import destroy_process_group, free_port, init_process_group
from gcore_rl.models.tiny import build_char_tokenizer

CPU = torch.device("cpu")
TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # tests/cli_helpers.py, whose forkserver `process_helpers` forks ranks from
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="module")
def process_group():
    """A world of one (gloo) for the module's FSDP2 models; one intra-op thread, as the models are tiny and
    spinning OpenMP teams stall badly on a busy machine. Use with `pytest.mark.usefixtures("process_group")`."""
    assert not dist.is_initialized(), "another test left a process group behind"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    info = init_process_group(0, 1, free_port(), CPU)
    assert dist.get_world_size() == 1
    yield info
    destroy_process_group()
    torch.set_num_threads(threads)
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()
