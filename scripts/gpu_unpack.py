"""Put a drafter that came back from the GPU shot (scripts/gpu_pack.py: drafter-config.json and
drafter-N.safetensors pieces, without the lm_head rows) back into one drafter folder, the rows
rebuilt from the target's own head.

    python scripts/gpu_unpack.py FILES_AT runs/gpu-drafter [TARGET]
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from blockspec.drafters.dflash import DFlashDraftModel
from blockspec.targets.loading import load_target

source, destination = Path(sys.argv[1]), Path(sys.argv[2])
pieces = sorted(source.glob("drafter-*.safetensors"))
if not pieces or not (source / "drafter-config.json").is_file():
    sys.exit(f"{source} holds no drafter-config.json / drafter-N.safetensors pieces")
tensors = {}
for piece in pieces:
    tensors.update(load_file(piece))
with tempfile.TemporaryDirectory() as staging:
    staging = Path(staging)
    shutil.copy(source / "drafter-config.json", staging / "config.json")
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    model = DFlashDraftModel.from_pretrained(staging)
target = load_target(sys.argv[3] if len(sys.argv) > 3 else "default")
if model.own_head() is None:  # a trained head came back with the other weights
    model.stored_head = model.head(target)[0].detach().clone()  # the target head's rows for the draft vocabulary
model.save_pretrained(destination, dtype=torch.float16)
print(f"drafter unpacked to {destination}")
