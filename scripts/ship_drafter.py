"""Copy a trained drafter into the package as the shipped one, weights stored in float16
(half the size; the engine runs it in the target's dtype)."""

import shutil
import sys
from pathlib import Path

import torch

from blockspec.drafters.dflash import DFlashDraftModel

source, destination = Path(sys.argv[1]), Path(sys.argv[2])
DFlashDraftModel.from_pretrained(source).save_pretrained(destination, dtype=torch.float16)
if len(sys.argv) > 3:
    shutil.copy(sys.argv[3], destination / "training.png")
print(f"shipped {source} -> {destination}")
