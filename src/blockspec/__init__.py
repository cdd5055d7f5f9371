"""blockspec: lossless DFlash block-diffusion speculative decoding for Hugging Face causal LMs."""

__version__ = "0.1.0"

from blockspec.errors import (  # noqa: E402
    BlockspecError,
    DrafterMismatchError,
    DrafterNotFoundError,
    InvalidArgumentError,
    TargetNotFoundError,
)


def load(*args, **kwargs):
    """Load a target (and a drafter) into a ready-to-use :class:`blockspec.pipeline.SpecDecoder`."""
    from blockspec.pipeline import load as _load

    return _load(*args, **kwargs)


__all__ = [
    "__version__",
    "load",
    "BlockspecError",
    "DrafterMismatchError",
    "DrafterNotFoundError",
    "InvalidArgumentError",
    "TargetNotFoundError",
]
