"""Copy a trained drafter into the package as the shipped one, weights stored in float16
(half the size; the engine runs it in the target's dtype).

    python scripts/ship_drafter.py runs/ab/ARM/final src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16 \
        [runs/ab/ARM/metrics.png]

The destination's model card (README.md) survives a re-ship: update its numbers by hand."""

import argparse
import shutil
import sys
from pathlib import Path

import torch

from blockspec.drafters.dflash import DFlashDraftModel
from blockspec.errors import BlockspecError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a drafter folder written by `blockspec train` (its final/)")
    parser.add_argument("destination", type=Path, help="the folder to write (replaced atomically)")
    parser.add_argument("plot", type=Path, nargs="?", default=None,
                        help="a training plot to copy beside it as training.png")
    args = parser.parse_args()
    plot = args.plot
    if plot is not None and not plot.is_file():
        parser.error(f"no plot at {plot}")
    try:
        model = DFlashDraftModel.from_pretrained(args.source)
    except (BlockspecError, OSError, ValueError) as error:
        parser.error(str(error))
    card = args.destination / "README.md"
    card_text = card.read_text() if card.exists() else None
    model.save_pretrained(args.destination, dtype=torch.float16)  # atomic: a reader sees all or nothing
    if card_text is not None:
        card.write_text(card_text)
    if plot is not None:
        shutil.copy(plot, args.destination / "training.png")
    print(f"shipped {args.source} -> {args.destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
