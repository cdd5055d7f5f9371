"""One training strategy per drafting method, one file each (the trainer's `Method`): it
builds the model, computes the loss of a batch and says what it supports; the trainer
does everything else. Adding a method = its file here, and its entry in METHODS."""

from blockspec.training.methods.dflash import DFlashMethod
from blockspec.training.methods.draft_model import DraftModelMethod
from blockspec.training.methods.eagle3 import Eagle3Method
from blockspec.training.methods.mtp import MTPMethod

#: --method value -> its strategy
METHODS = {method.name: method for method in (DFlashMethod(), MTPMethod(), DraftModelMethod(), Eagle3Method())}
