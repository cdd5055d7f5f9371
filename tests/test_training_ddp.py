"""Scale-out with the standard tools: the same trainer under torchrun, DDP and FSDP2
(gloo on CPU), against one process with the same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("ddp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_process(out: Path, tag: str, *options: str) -> None:
    subprocess.run([sys.executable, str(WORKER), str(out), tag, *options], check=True, env=ENV, timeout=300)


def two_processes(out: Path, tag: str, *options: str) -> None:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(out), tag, *options],
                   check=True, env=ENV, timeout=300)


def assert_matches(weights: dict, reference: dict, what: str) -> None:
    assert weights.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=1e-5,
                                   msg=f"{name}: {what}")


# dflash: DDP's wrapper reduces the gradients; eagle3 and mtp call their model several times
# per step, and the trainer averages the gradients itself
@pytest.mark.parametrize("method", ["dflash", "eagle3", "mtp"])
def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path, method):
    one_process(tmp_path, "single", "--method", method)
    two_processes(tmp_path, "ddp", "--method", method, "--parallel", "ddp")
    single = load_file(tmp_path / "single-world1-rank0.safetensors")
    rank0 = load_file(tmp_path / "ddp-world2-rank0.safetensors")
    rank1 = load_file(tmp_path / "ddp-world2-rank1.safetensors")
    for name in single:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"
    assert_matches(rank0, single, "DDP differs from 1 process")


def test_fsdp_matches_one_process_and_resumes_exactly(tmp_path):
    one_process(tmp_path, "single")
    two_processes(tmp_path, "fsdp", "--parallel", "fsdp")
    single = load_file(tmp_path / "single-world1-rank0.safetensors")
    sharded = load_file(tmp_path / "fsdp-world2-rank0.safetensors")
    with safe_open(tmp_path / "fsdp-world2-rank0.safetensors", framework="pt") as handle:
        assert handle.metadata()["held_as"] == "DTensor"  # the parameters really were sharded
    assert_matches(sharded, single, "FSDP differs from 1 process")
    # the checkpoint rank 0 wrote from the shards is the same drafter
    from blockspec.drafters.dflash import DFlashDraftModel

    saved = DFlashDraftModel.from_pretrained(tmp_path / "run-fsdp" / "final").state_dict()
    assert_matches(saved, sharded, "the FSDP checkpoint differs from the gathered weights")
    # killed after step 2, resumed to step 3: the sharded optimizer state comes back
    two_processes(tmp_path, "resumed", "--parallel", "fsdp", "--max-steps", "2")
    two_processes(tmp_path, "resumed", "--parallel", "fsdp", "--resume")
    resumed = load_file(tmp_path / "resumed-world2-rank0.safetensors")
    for name in sharded:
        assert torch.equal(resumed[name], sharded[name]), f"resumed FSDP run differs on {name}"


def test_fsdp_trains_an_independent_draft_model(tmp_path):
    one_process(tmp_path, "single", "--method", "draft-model")
    two_processes(tmp_path, "fsdp", "--method", "draft-model", "--parallel", "fsdp")
    assert_matches(load_file(tmp_path / "fsdp-world2-rank0.safetensors"),
                   load_file(tmp_path / "single-world1-rank0.safetensors"), "FSDP draft model differs from 1 process")


@pytest.mark.parametrize("parallel", ["zero3", "FSDP"])
def test_unknown_parallel_mode_is_an_error(parallel):
    from blockspec.errors import InvalidArgumentError
    from blockspec.training.config import TrainConfig
    from blockspec.training.methods.dflash import DFlashMethod
    from blockspec.training.trainer import Trainer
    from conftest import tiny_target

    records = [{"prompt_ids": [3, 4, 5], "response_ids": list(range(10, 30))}] * 3
    with pytest.raises(InvalidArgumentError, match="parallel must be ddp or fsdp"):
        Trainer(TrainConfig(data="unused", parallel=parallel, block_size=4, holdout=0), tiny_target("llama"),
                DFlashMethod(), records)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_fsdp_refuses_the_methods_it_cannot_shard(method):
    from blockspec.errors import InvalidArgumentError
    from blockspec.training.config import TrainConfig
    from blockspec.training.methods import METHODS
    from blockspec.training.trainer import check_config

    config = TrainConfig(method=method, parallel="fsdp")
    check_config(config, METHODS[method], world_size=1)  # one process ignores --parallel
    with pytest.raises(InvalidArgumentError, match="--parallel ddp"):
        check_config(config, METHODS[method], world_size=2)
