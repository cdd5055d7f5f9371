"""Scale-out with the standard tools: the same trainer under torchrun (DDP, gloo on CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("ddp_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(WORKER), str(tmp_path)], check=True, env=env, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(tmp_path)],
                   check=True, env=env, timeout=300)
    single = load_file(tmp_path / "world1-rank0.safetensors")
    rank0 = load_file(tmp_path / "world2-rank0.safetensors")
    rank1 = load_file(tmp_path / "world2-rank1.safetensors")
    for name in single:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-4, atol=1e-5, msg=f"{name} differs from 1 process")
