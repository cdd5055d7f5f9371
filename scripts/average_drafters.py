"""Average the weights of several DFlash drafters fine-tuned from one parent (a "model soup").

    python scripts/average_drafters.py OUTPUT DRAFTER [DRAFTER ...] [--weights 1,1,2]

The campaign's arms all start from the shipped drafter and train a few thousand steps on
different data and seeds; their held-out tau scatters around the parent's by about the
run-to-run noise (docs/training.md). Weights fine-tuned from one parent stay in one basin,
where their mean often measures better than any of them (Wortsman et al. 2022, "Model soups"),
at no training cost. Only drafters that are the same model can be averaged: the same config
(layers, shapes, target layers, block size) and the same draft vocabulary (`d2t`); a trained
head of their own is averaged like any other weight. Loaded and written through the drafter's
own checkpoint code (atomic write, `d2t` offsets as vLLM reads them).
"""
import argparse

import torch

from blockspec.drafters.dflash import DFlashDraftModel
from blockspec.errors import BlockspecError

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("output", help="where to write the averaged drafter")
parser.add_argument("drafters", nargs="+", help="two or more drafter folders (same config and vocabulary)")
parser.add_argument("--weights", help="comma-separated mixing weights, one per drafter (default: equal)")
args = parser.parse_args()

if len(args.drafters) < 2:
    parser.error("give at least two drafters to average")
if args.weights is None:
    mix = [1.0] * len(args.drafters)
else:
    try:
        mix = [float(w) for w in args.weights.split(",")]
    except ValueError:
        parser.error(f"--weights {args.weights!r} is not a comma-separated list of numbers")
    if len(mix) != len(args.drafters) or any(w < 0 for w in mix) or sum(mix) <= 0:
        parser.error(f"--weights needs {len(args.drafters)} non-negative numbers with a positive sum")
mix = [w / sum(mix) for w in mix]

try:
    models = [DFlashDraftModel.from_pretrained(folder) for folder in args.drafters]
except BlockspecError as error:  # not a drafter folder, or not a DFlash one
    parser.error(str(error))


def shape_of(model):  # what must agree for the weights to mean the same thing
    config = model.config.to_hf_dict()
    config.pop("torch_dtype", None)
    return config


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same target head rows, one of them perhaps shipped in a coarser dtype (float16)."""
    coarse = min(a.dtype, b.dtype, key=lambda dtype: torch.finfo(dtype).bits)
    return a.shape == b.shape and torch.equal(a.to(coarse), b.to(coarse))


first, first_shape = models[0], shape_of(models[0])
for folder, model in zip(args.drafters[1:], models[1:]):
    shape = shape_of(model)
    if shape != first_shape:
        differ = sorted(k for k in first_shape.keys() | shape.keys() if first_shape.get(k) != shape.get(k))
        parser.error(f"{folder} is not the same model as {args.drafters[0]}: config differs in {differ}")
    if first.config.draft_vocab_size and not torch.equal(model.d2t, first.d2t):
        parser.error(f"{folder} drafts over another vocabulary than {args.drafters[0]} (`d2t` differs)")
    if (model.stored_head is None) != (first.stored_head is None) or (
            model.stored_head is not None and not same_rows(model.stored_head, first.stored_head)):
        parser.error(f"{folder} stores other target head rows than {args.drafters[0]}")

states = [model.state_dict() for model in models]
averaged = {}
for name, tensor in states[0].items():
    if tensor.is_floating_point():
        averaged[name] = sum(w * state[name].double() for w, state in zip(mix, states)).to(torch.float32)
    else:  # d2t: equal in all of them (checked above)
        averaged[name] = tensor
first.float().load_state_dict(averaged)
first.save_pretrained(args.output)
print(f"wrote {args.output}: the mean of {len(models)} drafters, weights {', '.join(f'{w:.3f}' for w in mix)}")
