"""Usage: python scripts/swap_draft_vocab.py TRAINED_FOLDER OUTPUT

Writes the trained drafter with the shipped drafter's draft vocabulary (its d2t, and the head
rows for it, which are the target's), as runs/campaign/train-16-vocab11 was made (session 24)."""
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
source, output = Path(sys.argv[1]), Path(sys.argv[2])
shipped = Path("src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16")
tensors = load_file(source / "model.safetensors")
vocab = load_file(shipped / "model.safetensors")
tensors["d2t"] = vocab["d2t"].clone()
tensors["lm_head.weight"] = vocab["lm_head.weight"].to(tensors["lm_head.weight"].dtype).clone()
output.mkdir(parents=True, exist_ok=True)
save_file(tensors, str(output / "model.safetensors"))
shutil.copy(source / "config.json", output / "config.json")
print("wrote", output)
