"""Copy a trained drafter into the package as the shipped one, weights stored in float16
(half the size; the engine runs it in the target's dtype)."""

import shutil
import sys
from pathlib import Path

import torch

from blockspec.drafters.dflash import DFlashDraftModel

source, destination = Path(sys.argv[1]), Path(sys.argv[2])
card = destination / "README.md"
card_text = card.read_text() if card.exists() else None  # the model card survives a re-ship (update its numbers)
DFlashDraftModel.from_pretrained(source).save_pretrained(destination, dtype=torch.float16)
if card_text is not None:
    card.write_text(card_text)
if len(sys.argv) > 3:
    shutil.copy(sys.argv[3], destination / "training.png")
print(f"shipped {source} -> {destination}")
