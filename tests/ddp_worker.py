"""Run by test_training_ddp.py, under torchrun or alone: a few training steps on a tiny target."""

import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_target  # noqa: E402

from blockspec.training.config import TrainConfig  # noqa: E402
from blockspec.training.trainer import DFlashTrainer  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    target = tiny_target("llama")
    generator = torch.Generator().manual_seed(0)
    records = [{"prompt_ids": torch.randint(2, 90, (5,), generator=generator).tolist(),
                "response_ids": torch.randint(2, 90, (20 + 3 * i,), generator=generator).tolist()} for i in range(8)]
    config = TrainConfig(data="unused", output=os.path.join(out_dir, "run"), num_layers=1, block_size=4,
                         num_anchors=6, batch_size=4, epochs=2, max_steps=3, holdout=0, eval_every=0,
                         save_every=1000, lr=1e-3)
    trainer = DFlashTrainer(config, target, records)
    trainer.run()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()},
              os.path.join(out_dir, f"world{world}-rank{rank}.safetensors"))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
