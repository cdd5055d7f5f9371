"""The `blockspec` command. Only this module (and serve/) prints or parses arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys

from blockspec import __version__
from blockspec.errors import BlockspecError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="Lossless block-diffusion speculative decoding.")
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="the prompt (instruct targets get their chat template unless --raw)")
    gen.add_argument("--target", default="default", help="'default', a model folder, a .gguf file or a hub id")
    gen.add_argument("--drafter", default="auto",
                     help="'auto' (the shipped drafter, else prompt lookup), 'none', 'prompt-lookup' or a drafter folder")
    gen.add_argument("--block-size", type=int, default=None, help="anchor + drafted tokens per step (default 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--context-window", type=_positive_int, default=None,
                     help="cap the drafter's cached context at this many positions (long prompts)")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: all cores)")
    gen.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modelling code")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.set_defaults(run=_generate)
    return parser


def _generate(args) -> int:
    import blockspec
    from blockspec.decoding.sampling import SamplingParams

    # Check what needs no model before loading one: bad input fails in milliseconds.
    if args.block_size is not None and args.block_size < 1:
        raise blockspec.InvalidArgumentError(f"block size must be >= 1, got {args.block_size}")
    if args.max_new_tokens < 1:
        raise blockspec.InvalidArgumentError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise blockspec.InvalidArgumentError("the prompt is empty")
    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    decoder = blockspec.load(args.target, args.drafter, block_size=args.block_size, device=args.device,
                             dtype=args.dtype, threads=args.threads, trust_remote_code=args.trust_remote_code,
                             context_window=args.context_window)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, stop=args.stop, raw=args.raw)
    if args.json:
        result = decoder.generate(args.prompt, **options)
        print(json.dumps(result.as_dict()))
        return 0
    if args.stream:
        for piece in decoder.stream(args.prompt, **options):
            print(piece, end="", flush=True)
        result = decoder.last_result
        print()
    else:
        result = decoder.generate(args.prompt, **options)
        print(result.text)
    drafter = decoder.drafter.name if decoder.drafter else "none"
    print(f"{result.stats.summary()} drafter={drafter} block={decoder.block_size} target={decoder.target.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return args.run(args)
    except BlockspecError as error:
        print(f"blockspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("blockspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
