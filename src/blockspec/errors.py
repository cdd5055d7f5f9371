"""Typed errors. The CLI turns each into one line on stderr and a non-zero exit."""


class BlockspecError(Exception):
    """Base class: a problem with the user's input or set-up, reported without a traceback."""


class TargetNotFoundError(BlockspecError):
    """The target spec names no local folder, GGUF file, packaged model or reachable hub id."""


class DrafterNotFoundError(BlockspecError):
    """The drafter spec names no known drafter and no readable drafter folder."""


class DrafterMismatchError(BlockspecError):
    """The drafter does not fit the target (hidden size, vocabulary, layer ids, fingerprint)."""


class InvalidArgumentError(BlockspecError, ValueError):
    """A generation argument is out of range (temperature, top-p, top-k, block size, prompt...)."""
