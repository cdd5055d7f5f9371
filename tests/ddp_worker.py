"""Run by test_training_ddp.py, under torchrun or alone: a few training steps on a tiny target.

    ddp_worker.py OUT_DIR TAG [--method dflash|eagle3|mtp|draft-model] [--parallel ddp|fsdp]
                  [--max-steps N] [--resume]

writes OUT_DIR/TAG-world{W}-rank{R}.safetensors: the full weights each rank ends with
(under FSDP only rank 0 holds them, gathered from the shards).
"""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_target  # noqa: E402

from blockspec.training.config import TrainConfig  # noqa: E402
from blockspec.training.methods import METHODS  # noqa: E402
from blockspec.training.trainer import Trainer, finish_distributed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("tag")
    parser.add_argument("--method", default="dflash")
    parser.add_argument("--parallel", default="ddp")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = tiny_target("llama")
    generator = torch.Generator().manual_seed(0)
    records = [{"prompt_ids": torch.randint(2, 90, (5,), generator=generator).tolist(),
                "response_ids": torch.randint(2, 90, (20 + 3 * i,), generator=generator).tolist()} for i in range(8)]
    config = TrainConfig(method=args.method, data="unused", output=os.path.join(args.out_dir, f"run-{args.tag}"),
                         num_layers=1, block_size=4, num_anchors=6, batch_size=4, epochs=2, max_steps=args.max_steps,
                         holdout=0, eval_every=0, save_every=1, lr=1e-3, parallel=args.parallel,
                         precision="fp32")  # the ranks must match one process to 1e-4
    trainer = Trainer(config, target, METHODS[args.method], records)
    trainer.run(resume=args.resume)
    model = trainer.full_model()  # collective under FSDP
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or args.parallel == "ddp":
        # metadata: how the trained parameters were held (DTensor shards under FSDP)
        held_as = type(next(trainer.model.parameters())).__name__
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                  os.path.join(args.out_dir, f"{args.tag}-world{world}-rank{rank}.safetensors"),
                  metadata={"held_as": held_as})
    if world > 1:
        finish_distributed()  # as `blockspec train` ends under torchrun


if __name__ == "__main__":
    main()
