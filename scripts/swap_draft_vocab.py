"""Give a trained DFlash drafter another drafter's draft vocabulary.

    python scripts/swap_draft_vocab.py TRAINED OUTPUT [--vocab-from FOLDER | --whole-vocabulary]

`train` rebuilds the draft vocabulary from its data; a campaign round trained on a few rounds'
data can end with a vocabulary that covers less of the held-out text than the shipped one.
The vocabulary is only `d2t` and the target head's rows for it (the drafter borrows the
target's head), so the trained layers keep their meaning under another vocabulary of the
same size. Loaded and written through the drafter's own checkpoint code (atomic write,
`d2t` offsets as vLLM reads them). As runs/campaign/train-16-vocab11 was made (session 24).
`--whole-vocabulary` writes the same layers drafting over the target's whole vocabulary (no
`d2t`): what the reduced vocabulary costs in tau (docs/training.md, session 28).
"""
import argparse
import copy

import torch

from blockspec.drafters.dflash import DFlashDraftModel
from blockspec.errors import BlockspecError

SHIPPED = "src/blockspec/checkpoints/smollm2-135m-instruct-dflash-b16"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("trained", help="the trained drafter folder")
parser.add_argument("output", help="where to write the drafter with the other vocabulary")
source = parser.add_mutually_exclusive_group()
source.add_argument("--vocab-from", default=SHIPPED, help="the drafter whose vocabulary to take (default: the shipped one)")
source.add_argument("--whole-vocabulary", action="store_true", help="draft over the target's whole vocabulary")
args = parser.parse_args()

try:
    model = DFlashDraftModel.from_pretrained(args.trained)
    donor = None if args.whole_vocabulary else DFlashDraftModel.from_pretrained(args.vocab_from)
except BlockspecError as error:  # not a drafter folder, or not a DFlash one
    parser.error(str(error))
if model.own_head() is not None:
    parser.error(f"{args.trained} drafts through a trained head of its own: its rows belong to its vocabulary")
if args.whole_vocabulary:
    config = copy.deepcopy(model.config)
    config.draft_vocab_size = None
    whole = DFlashDraftModel(config)
    whole.load_state_dict({k: v for k, v in model.state_dict().items() if k != "d2t"})
    whole.save_pretrained(args.output)
    print("wrote", args.output)
    raise SystemExit(0)
if not model.config.draft_vocab_size or model.config.draft_vocab_size != donor.config.draft_vocab_size:
    parser.error(f"draft vocabulary sizes differ: {model.config.draft_vocab_size} (trained) against "
                 f"{donor.config.draft_vocab_size} ({args.vocab_from})")
with torch.no_grad():
    model.d2t.copy_(donor.d2t)
model.stored_head = donor.stored_head
model.save_pretrained(args.output)
print("wrote", args.output)
