"""The GPU shot's way back (scripts/gpu_drafter.sh): $OUT takes files of at most 16 MiB, so
the drafter goes as fp16 pieces (drafter-N.safetensors) beside drafter-config.json, without
its lm_head rows when they are a copy of the target's (the target's own head rebuilds them:
scripts/gpu_unpack.py); a trained head (config `trained_lm_head`) travels as the weight it is.

    python scripts/gpu_pack.py RUN/final OUT
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PIECE_BYTES = 14 * 2**20

final, out = Path(sys.argv[1]), Path(sys.argv[2])
tensors = load_file(final / "model.safetensors")
if not json.loads((final / "config.json").read_text()).get("trained_lm_head"):
    tensors.pop("lm_head.weight", None)
tensors = {n: t.to(torch.float16) if t.is_floating_point() else t for n, t in tensors.items()}
pieces, current, size = [], {}, 0
for name in sorted(tensors):
    nbytes = tensors[name].numel() * tensors[name].element_size()
    if current and size + nbytes > PIECE_BYTES:
        pieces.append(current)
        current, size = {}, 0
    current[name], size = tensors[name].contiguous(), size + nbytes
pieces.append(current)
for index, piece in enumerate(pieces):
    save_file(piece, out / f"drafter-{index}.safetensors")
shutil.copy(final / "config.json", out / "drafter-config.json")
for name in ("metrics.jsonl", "metrics.png"):
    if (final.parent / name).exists():
        shutil.copy(final.parent / name, out / name)
print(f"drafter in {len(pieces)} pieces written to {out}")
