"""The `blockspec` command. Only this module (and serve/) prints or parses arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys

from blockspec import __version__
from blockspec.bench.datasets import PROMPT_FORMATS
from blockspec.defaults import DEFAULT_TREE_BUDGET, DRAFTER_DTYPES
from blockspec.errors import BlockspecError, InvalidArgumentError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _layer_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer ids like 1,8,15, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one layer id")
    return ids


def _add_drafter_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter-dtype", default="auto", choices=DRAFTER_DTYPES,
                        help="the precision a trained drafter computes in (auto: the target's, but bfloat16 beside a "
                             "float32 target on a CPU with bf16 matrix units (AMX)); the output is the target's either way")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="Lossless block-diffusion speculative decoding.")
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt (instruct targets get their chat template unless --raw)")
    gen.add_argument("--input", default=None, metavar="PROMPTS.jsonl",
                     help="offline batch: one prompt per line (prompt/question/messages), decoded together; "
                          "one JSON result per line on stdout (or --output)")
    gen.add_argument("--output", default=None, help="with --input: write the JSONL results here")
    gen.add_argument("--max-batch", type=_positive_int, default=8, help="with --input: prompts decoded together")
    gen.add_argument("--target", default="default", help="'default', a model folder, a .gguf file or a hub id")
    gen.add_argument("--drafter", default="hybrid",
                     help="'hybrid' (the shipped drafter with prompt lookup beside it, each step the better one), "
                          "'auto' (the shipped drafter, else prompt lookup), 'none', 'prompt-lookup' or a drafter folder")
    gen.add_argument("--block-size", type=int, default=None,
                     help="the most tokens (anchor + drafts) a step verifies (default: the drafter's, at most 16); "
                          "each step drafts what pays on this machine, down to none")
    gen.add_argument("--fixed-block", action="store_true",
                     help="draft a full block (or tree) every step instead of planning each step")
    gen.add_argument("--tree-budget", type=int, default=DEFAULT_TREE_BUDGET,
                     help="verify token trees (DDTree) of at most this many drafted nodes per step, where the "
                          f"drafter gives per-position distributions (default {DEFAULT_TREE_BUDGET}; the planner "
                          "picks each step's count)")
    _add_drafter_dtype(gen)
    gen.add_argument("--chain", action="store_true", help="draft one chain per step, not a token tree")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--force-drafter", action="store_true",
                     help="use a drafter trained for another tokenizer (shapes must still fit)")
    gen.add_argument("--context-window", type=_positive_int, default=None,
                     help="cap the drafter's cached context at this many positions (long prompts)")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: all cores, or OMP_NUM_THREADS when set)")
    gen.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modelling code")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.add_argument("--compare", action="store_true",
                     help="also run the plain autoregressive loop (interleaved, twice each) and print the speedup")
    gen.add_argument("--mode", default="speculative", choices=["speculative", "diffusion"],
                     help="diffusion: the DFlash drafter generates WITHOUT verification (fast, LOSSY, never the default)")
    gen.add_argument("--diffusion-steps", type=_positive_int, default=1,
                     help="diffusion mode: drafter passes per block, unmasking the most confident positions first")
    gen.add_argument("--confidence-threshold", type=float, default=None,
                     help="diffusion mode: unmask every position above this confidence per pass (overrides steps)")
    gen.set_defaults(run=_generate)

    data = commands.add_parser("data", help="build a training set whose responses the target regenerates")
    data.add_argument("--output", required=True, help="folder for the shards (rerun to resume)")
    data.add_argument("--target", default="default")
    data.add_argument("--prompts", action="append", default=None, metavar="SOURCE",
                      help="JSONL file, datasets name, local dataset folder, builtin:coding_tasks / "
                           "builtin:everyday_questions, or python-functions:stdlib / python-functions:DIR "
                           "(HumanEval-style signatures from Python source), optionally sliced as "
                           "SOURCE[start:stop]; repeatable")
    data.add_argument("--split", default="train")
    data.add_argument("--limit", type=_positive_int, default=None, help="at most N prompts from each source")
    data.add_argument("--synthesize", type=int, default=0, help="add N prompts written by the target itself")
    data.add_argument("--synthesize-opening", action="append", default=None, metavar="TEXT",
                      help="synthesized prompts start with these words (repeatable, used in turn), e.g. 'Let $' "
                           "or 'How many' for math questions")
    data.add_argument("--follow-up", default=None, metavar="FOLDER",
                      help="a data folder this target wrote (FOLDER or FOLDER[start:stop]): continue each of its "
                           "conversations with a user turn the target writes, and regenerate the answer "
                           "(multi-turn data, like MT-Bench's second turns)")
    data.add_argument("--max-new-tokens", type=_positive_int, default=256)
    data.add_argument("--temperature", type=float, default=0.0)
    data.add_argument("--batch-size", type=_positive_int, default=64)
    data.add_argument("--shard-size", type=_positive_int, default=128)
    data.add_argument("--feature-layers", type=_layer_ids, default=None, metavar="IDS",
                      help="also store these target layers' features (fp16), e.g. 1,8,15,22,27: training then "
                           "skips the target pass (use the drafter's target_layer_ids)")
    data.add_argument("--store-topk", type=int, default=0, metavar="K",
                      help="also store the target's top-K next-token distribution at every response position "
                           "(train with --distill-topk <= K: the target's distribution, no second target pass)")
    data.add_argument("--prompt-prefix", default="", help="text put before every text prompt (of --prompts "
                      "and --synthesize)")
    data.add_argument("--prompt-suffix", default="", help="text put after every text prompt (of --prompts and "
                      "--synthesize), e.g. a benchmark's instruction (use $'...' in bash for newlines)")
    data.add_argument("--prompt-format", choices=sorted(PROMPT_FORMATS), default=None,
                      help="wrap every text prompt as `blockspec bench` does: math = the GSM8K / MATH-500 "
                           "boxed-answer instruction after it, code = the HumanEval instruction before it")
    data.add_argument("--from-text", action="store_true",
                      help="take responses from the sources' own text (answer/response/completion/output) instead of "
                           "regenerating them; train on it with --distill-topk K (self logit distillation)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--threads", type=_positive_int, default=None)
    data.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N, mps")
    data.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="the target's precision while it writes: bfloat16 is 2.1x faster per CPU-second on "
                           "a CPU with bf16 units (AMX), and its greedy text is float32's at ~99%% of positions")
    data.set_defaults(run=_data)

    train = commands.add_parser("train", help="train a DFlash drafter (options: --key value, see TrainConfig)")
    train.add_argument("--config", default=None, help="JSON file of TrainConfig fields")
    train.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint")
    train.set_defaults(run=_train)

    check = commands.add_parser("check-drafter", help="validate a drafter folder against a target")
    check.add_argument("folder")
    check.add_argument("--target", default="default")
    check.set_defaults(run=_check_drafter)

    export = commands.add_parser("export", help="write a drafter in the format of transformers or speculators")
    export.add_argument("folder", help="a blockspec (reference-format) drafter folder")
    export.add_argument("output", help="folder to write")
    export.add_argument("--to", required=True, choices=["transformers", "speculators", "sglang"], dest="format",
                        help="sglang: an EAGLE-3 drafter with its layer ids as SGLang reads them")
    export.add_argument("--target", default=None,
                        help="the target (fills special token ids, the verifier's architectures and, for a reduced "
                             "draft vocabulary, the speculators lm_head)")
    export.add_argument("--verifier", default=None, help="name_or_path written as the speculators verifier")
    export.set_defaults(run=_export)

    imp = commands.add_parser("import", help="bring a DFlash drafter (reference, transformers or speculators format; "
                                              "a folder or a hub id) into blockspec's format")
    imp.add_argument("source")
    imp.add_argument("output")
    imp.add_argument("--target", default=None, help="fills what the format lacks (vocabulary size, layer count)")
    imp.set_defaults(run=_import)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    serve.add_argument("--target", default="default")
    serve.add_argument("--drafter", default="auto")
    serve.add_argument("--block-size", type=_positive_int, default=8)
    serve.add_argument("--host", default="127.0.0.1", help="loopback by default; 0.0.0.0 exposes the server")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default=None, help="the id clients send as `model` (default: the target)")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route but /health "
                       "(better: the BLOCKSPEC_API_KEY environment variable, which `ps` does not show)")
    serve.add_argument("--max-queue", type=_positive_int, default=32, help="queued requests beyond this get HTTP 429")
    serve.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request, queue included")
    serve.add_argument("--max-body-bytes", type=_positive_int, default=2 * 2**20,
                       help="larger request bodies get HTTP 413 before they are read")
    serve.add_argument("--max-batch", type=_positive_int, default=8,
                       help="requests decoded together in one target pass per step (1: one at a time)")
    serve.add_argument("--threads", type=_positive_int, default=None)
    serve.add_argument("--tree-budget", type=_positive_int, default=DEFAULT_TREE_BUDGET,
                       help="verify token trees of at most this many nodes per request and step (batched; the planner "
                            f"picks the count; default {DEFAULT_TREE_BUDGET})")
    _add_drafter_dtype(serve)
    serve.add_argument("--chain", action="store_true", help="draft one chain per request and step instead of trees")
    serve.set_defaults(run=_serve)

    serving = commands.add_parser("bench-serve", help="batched serving throughput at several concurrency levels, "
                                                     "speculative vs the non-speculative batched baseline")
    serving.add_argument("--target", default="default")
    serving.add_argument("--drafter", default="auto")
    serving.add_argument("--block-size", type=_positive_int, default=8)
    serving.add_argument("--concurrency", default="1,2,4,8")
    serving.add_argument("--requests", type=_positive_int, default=16, help="requests per configuration")
    serving.add_argument("--repeats", type=_positive_int, default=1,
                         help="runs of each configuration per level, alternating (medians are reported)")
    serving.add_argument("--max-new-tokens", type=_positive_int, default=64)
    serving.add_argument("--dataset", default="gsm8k")
    serving.add_argument("--data-dir", default=None)
    serving.add_argument("--seed", type=int, default=0)
    serving.add_argument("--tree-budget", type=_positive_int, default=DEFAULT_TREE_BUDGET,
                         help=f"as for serve (default {DEFAULT_TREE_BUDGET})")
    _add_drafter_dtype(serving)
    serving.add_argument("--chain", action="store_true", help="as for serve: chains instead of trees")
    serving.add_argument("--output", default="runs/bench-serve")
    serving.set_defaults(run=_bench_serve)

    bench = commands.add_parser("bench", help="speedup and acceptance of every method vs plain decoding")
    bench.add_argument("--target", default="default")
    bench.add_argument("--drafter", default="auto", help="DFlash drafter folder ('auto': the shipped one)")
    bench.add_argument("--datasets", default="gsm8k,math500,humaneval,mt_bench",
                       help="comma-separated: gsm8k, math500, humaneval, mt_bench, or JSONL files")
    bench.add_argument("--data-dir", default=None, help="local copies (layout of ../shared/data); else by name")
    bench.add_argument("--limit", type=_positive_int, default=10, help="prompts per dataset (seeded subset)")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--methods", default=None,
                       help="comma-separated, the first is the baseline, the second is compared with each later "
                            "one prompt by prompt (default: baseline, default, default-chain, prompt-lookup, "
                            "dflash-tree, dflash-auto, dflash-b16, dflash-b8, hf-generate, hf-prompt-lookup, "
                            "hf-dflash-b16); dflash-bN for any block size N; `default` is what `blockspec generate` "
                            "does; LABEL=FOLDER for another trained drafter (a LABEL default-... or "
                            "default-chain-...: the default command with that DFlash drafter)")
    _add_drafter_dtype(bench)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--repeats", type=_positive_int, default=1,
                       help="rounds of every method per prompt; each keeps its run of median time per token "
                            "(a noisy machine's slow runs then move no ratio)")
    bench.add_argument("--quick", action="store_true",
                       help="T=0, at most 64 new tokens, 2 prompts per dataset; baseline, transformers generate, "
                            "prompt lookup, blockspec DFlash (B=8) and the default command")
    bench.add_argument("--no-memory", action="store_true",
                       help="skip the peak-memory runs (one process per method, one prompt each)")
    bench.add_argument("--threads", type=_positive_int, default=None)
    bench.add_argument("--output", default="runs/bench")
    bench.set_defaults(run=_bench)

    heldout = commands.add_parser("eval-drafter", help="held-out acceptance (tau, position-1 rate) of a drafter on "
                                  "benchmark test prompts, T=0, no timing")
    heldout.add_argument("drafter", help="drafter folder, 'auto' or a named drafter")
    heldout.add_argument("--target", default="default")
    heldout.add_argument("--datasets", default="gsm8k,math500,humaneval,mt_bench")
    heldout.add_argument("--data-dir", default=None, help="local copies (layout of ../shared/data); else by name")
    heldout.add_argument("--limit", type=_positive_int, default=8, help="prompts per dataset (seeded subset)")
    heldout.add_argument("--max-new-tokens", type=_positive_int, default=128)
    heldout.add_argument("--block-size", type=_positive_int, default=16)
    heldout.add_argument("--seed", type=int, default=1, help="which subset (the bench uses 0)")
    heldout.add_argument("--tree-budget", type=int, default=None,
                         help="verify token trees of N nodes every step (default: chains of block-size - 1 drafts)")
    _add_drafter_dtype(heldout)
    heldout.add_argument("--threads", type=_positive_int, default=None)
    heldout.add_argument("--output", default=None, help="also write the result as JSON here")
    heldout.set_defaults(run=_eval_drafter)
    return parser


def _eval_drafter(args) -> int:
    import json
    from pathlib import Path

    from blockspec.atomic import write_text
    from blockspec.drafters.registry import load_drafter
    from blockspec.targets.loading import load_target
    from blockspec.training.heldout import format_acceptance, heldout_acceptance

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if not datasets:
        raise BlockspecError("--datasets is empty")
    if args.tree_budget is not None and args.tree_budget < 1:
        raise InvalidArgumentError(f"tree node budget must be >= 1, got {args.tree_budget}")
    target = load_target(args.target, threads=args.threads)
    drafter = load_drafter(args.drafter, target, dtype=args.drafter_dtype)
    if drafter is None:
        raise BlockspecError("eval-drafter needs a drafter, not 'none'")
    result = heldout_acceptance(target, drafter, datasets=datasets, data_dir=args.data_dir, limit=args.limit,
                                max_new_tokens=args.max_new_tokens, block_size=args.block_size, seed=args.seed,
                                tree_budget=args.tree_budget)
    result["drafter"] = args.drafter
    print(format_acceptance(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        write_text(Path(args.output), json.dumps(result, indent=2) + "\n")
    return 0


def _generate(args) -> int:
    import blockspec
    from blockspec.decoding.sampling import SamplingParams

    # Check what needs no model before loading one: bad input fails in milliseconds.
    if args.block_size is not None and args.block_size < 1:
        raise blockspec.InvalidArgumentError(f"block size must be >= 1, got {args.block_size}")
    if args.tree_budget < 1:
        raise blockspec.InvalidArgumentError(f"tree node budget must be >= 1, got {args.tree_budget} "
                                             "(--chain drafts chains)")
    if args.max_new_tokens < 1:
        raise blockspec.InvalidArgumentError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if (args.prompt is None) == (args.input is None):
        raise blockspec.InvalidArgumentError("give a prompt, or --input PROMPTS.jsonl (not both)")
    if args.prompt is not None and not args.prompt.strip():
        raise blockspec.InvalidArgumentError("the prompt is empty")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.mode == "diffusion":
        if args.input is not None:
            raise blockspec.InvalidArgumentError("diffusion mode takes one prompt, not --input")
        return _generate_diffusion(args, params)
    decoder = blockspec.load(args.target, args.drafter, block_size=args.block_size, plan=not args.fixed_block,
                             tree_budget=None if args.chain else args.tree_budget,
                             device=args.device, dtype=args.dtype, threads=args.threads,
                             trust_remote_code=args.trust_remote_code, context_window=args.context_window,
                             force_drafter=args.force_drafter, drafter_dtype=args.drafter_dtype)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, stop=args.stop, raw=args.raw)
    if args.input is not None:
        return _generate_offline_batch(decoder, args, options)
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
    block = f"{decoder.block_size}" if args.fixed_block else f"<={decoder.block_size} (planned per step)"
    tree = f" trees<={decoder.tree_budget} nodes ({result.stats.tree_steps} tree steps)" if decoder.tree_budget else ""
    print(f"{result.stats.summary()} drafter={drafter} block={block}{tree} target={decoder.target.name}")
    for note in result.stats.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.compare and decoder.drafter is not None:
        _compare_with_plain_loop(decoder, args.prompt, options, result)
    return 0


def _generate_offline_batch(decoder, args, options) -> int:
    import time

    from blockspec.training.data import read_prompts

    prompts = read_prompts(args.input)
    if not prompts:
        raise BlockspecError(f"{args.input} holds no prompts")
    started = time.perf_counter()
    results = decoder.generate_batch(prompts, max_batch=args.max_batch, **options)
    wall = time.perf_counter() - started
    lines = "".join(json.dumps({"index": i, **r.as_dict()}) + "\n" for i, r in enumerate(results))
    if args.output:
        from blockspec.atomic import write_text

        write_text(args.output, lines)
    else:
        print(lines, end="")
    tokens = sum(len(r.token_ids) for r in results)
    print(f"[{len(results)} prompts, {tokens} tokens in {wall:.1f} s: {tokens / wall:.1f} tok/s, "
          f"up to {args.max_batch} decoded together]", file=sys.stderr)
    return 0


def _generate_diffusion(args, params) -> int:
    import blockspec
    from blockspec.decoding.diffusion import DiffusionDecoder, DiffusionStats

    print("blockspec: diffusion mode is LOSSY: the text is the drafter's, not the target's "
          "(no verification); use it only where that is acceptable", file=sys.stderr)
    drafter = "auto" if args.drafter == "hybrid" else args.drafter  # the default: diffusion needs the DFlash drafter alone
    decoder = blockspec.load(args.target, drafter, block_size=args.block_size, device=args.device, tree_budget=None,
                             dtype=args.dtype, threads=args.threads, trust_remote_code=args.trust_remote_code,
                             force_drafter=args.force_drafter, drafter_dtype=args.drafter_dtype)
    diffusion = DiffusionDecoder(decoder.target, decoder.drafter, args.block_size, args.diffusion_steps,
                                 args.confidence_threshold)
    stats = DiffusionStats(diffusion.block_size)
    prompt_ids = decoder.target.encode_prompt(args.prompt, raw=args.raw)
    tokens = []
    for chunk in diffusion.generate(prompt_ids, max_new_tokens=args.max_new_tokens, params=params, stats=stats):
        tokens += chunk
        if args.stream and not args.json:
            print(decoder.target.decode(chunk), end="", flush=True)
    text = decoder.target.decode(tokens)
    if args.json:
        print(json.dumps({"text": text, "token_ids": tokens, "mode": "diffusion", "stats": stats.as_dict()}))
        return 0
    print("" if args.stream else text)
    print(f"[diffusion, LOSSY | {stats.new_tokens} tokens in {stats.blocks} blocks, {stats.drafter_passes} drafter "
          f"passes | agreement with the target {stats.agreement:.0%} | "
          f"{stats.as_dict()['tokens_per_s']:.1f} tok/s]")
    return 0


def _compare_with_plain_loop(decoder, prompt, options, first_result) -> None:
    """Speedup over the plain loop on the same target, measured in this run: the two
    alternate (method, plain, method, plain) and the medians of decode time per token
    are compared, so that a busy machine slows both alike."""
    import statistics

    from blockspec.pipeline import SpecDecoder

    plain = SpecDecoder(decoder.target, None)
    method_tpot, plain_tpot = [first_result.stats.tpot_s], []
    plain_result = None
    for round_index in range(2):
        plain_result = plain.generate(prompt, **options)
        plain_tpot.append(plain_result.stats.tpot_s)
        if round_index == 0:
            method_tpot.append(decoder.generate(prompt, **options).stats.tpot_s)
    speedup = statistics.median(plain_tpot) / statistics.median(method_tpot)
    identical = plain_result.token_ids == first_result.token_ids
    print(f"plain autoregressive loop: {plain_result.stats.summary()}")
    print(f"speedup over the plain loop: {speedup:.2f}x (median decode time per token, 2 alternating runs each); "
          f"outputs identical: {'yes' if identical else 'NO'}")


def _data(args) -> int:
    from blockspec.targets.loading import load_target
    from blockspec.training.data import DataConfig, build_dataset

    prefix, suffix = args.prompt_prefix, args.prompt_suffix
    if args.prompt_format:
        if prefix or suffix:
            raise BlockspecError("--prompt-format already sets the prefix and suffix: drop --prompt-prefix/--prompt-suffix")
        prefix, suffix = PROMPT_FORMATS[args.prompt_format]
    config = DataConfig(output=args.output, prompts=args.prompts, split=args.split, limit=args.limit,
                        synthesize=args.synthesize, synthesize_openings=args.synthesize_opening,
                        follow_ups=args.follow_up, store_topk=args.store_topk,
                        max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, batch_size=args.batch_size, shard_size=args.shard_size,
                        seed=args.seed, feature_layers=args.feature_layers,
                        prompt_prefix=prefix, prompt_suffix=suffix, from_text=args.from_text, dtype=args.dtype)
    build_dataset(load_target(args.target, threads=args.threads, device=args.device or "cpu", dtype=args.dtype), config)
    return 0


def _train(args) -> int:
    from blockspec.targets.loading import check_device, load_target
    from blockspec.training.config import TrainConfig, load_config
    from blockspec.training.methods import METHODS
    from blockspec.training.trainer import Trainer, finish_distributed

    config = load_config(TrainConfig, args.config, args.overrides)
    if config.method not in METHODS:
        raise BlockspecError(f"unknown training method {config.method!r}: one of {', '.join(METHODS)}")
    if not config.data:
        raise BlockspecError("train needs --data FOLDER (built by `blockspec data`)")
    device = config.device
    if device:
        check_device(device)  # a missing GPU is one clear line, before any model loads
    if device == "cuda":  # one GPU per process under torchrun / accelerate launch
        import torch

        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    target = load_target(config.target, threads=config.threads, device=device or "cpu")
    Trainer(config, target, METHODS[config.method]).run(resume=args.resume)
    import torch.distributed as dist

    if dist.is_initialized():  # under torchrun: leave together, after rank 0 has written
        finish_distributed()
    return 0


def _check_drafter(args) -> int:
    from blockspec.export.check import check_drafter
    from blockspec.targets.loading import load_target

    problems = check_drafter(args.folder, load_target(args.target))
    if problems:
        print(f"{args.folder}: {len(problems)} problem(s) against target {args.target}:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"{args.folder}: OK, a valid drafter for target {args.target}")
    return 0


def _serve(args) -> int:
    import logging
    import math

    import uvicorn

    import blockspec
    from blockspec.serve.app import ServerConfig, create_app

    if not 0 < args.port < 65536:
        raise BlockspecError(f"port must be in 1..65535, got {args.port}")
    if not (math.isfinite(args.request_timeout) and args.request_timeout > 0):
        raise BlockspecError(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    api_key = args.api_key or os.environ.get("BLOCKSPEC_API_KEY") or None
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not loopback and api_key is None:
        print(f"blockspec serve: warning: --host {args.host} without an API key: anyone who reaches this machine "
              "can use the model (set BLOCKSPEC_API_KEY or --api-key)", file=sys.stderr, flush=True)
    # a keyless loopback server answers only requests addressed to loopback names (DNS rebinding);
    # a server bound elsewhere without a key is open by choice (warned above)
    allowed_hosts = ("127.0.0.1", "localhost", "[::1]", "::1") if loopback else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    decoder = blockspec.load(args.target, args.drafter, block_size=args.block_size, threads=args.threads,
                             tree_budget=None if args.chain else args.tree_budget, drafter_dtype=args.drafter_dtype)
    config = ServerConfig(model_name=args.model_name or args.target, api_key=api_key, max_queue=args.max_queue,
                          request_timeout_s=args.request_timeout, max_batch=args.max_batch,
                          max_body_bytes=args.max_body_bytes, allowed_hosts=allowed_hosts)
    print(f"serving {config.model_name} (drafter {decoder.drafter.name if decoder.drafter else 'none'}, "
          f"block {decoder.block_size}, {f'trees of at most {decoder.tree_budget} nodes' if decoder.tree_budget else 'chains'}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    for note in decoder.notes:
        print(f"blockspec serve: {note}", flush=True)
    uvicorn.run(create_app(decoder, config), host=args.host, port=args.port, log_level="warning")
    return 0


def _bench_serve(args) -> int:
    from pathlib import Path

    import blockspec
    from blockspec.bench.datasets import load_prompts
    from blockspec.bench.runner import machine_description
    from blockspec.bench.serving import report_serving, serving_bench

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise BlockspecError(f"--concurrency takes integers like 1,2,4,8, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise BlockspecError("--concurrency levels must be >= 1")
    decoder = blockspec.load(args.target, args.drafter, block_size=args.block_size,
                             tree_budget=None if args.chain else args.tree_budget, drafter_dtype=args.drafter_dtype)
    if decoder.drafter is None:
        raise BlockspecError("bench-serve compares a drafter with the plain batched loop: pass --drafter")
    prompts = [decoder.target.encode_prompt(p.turns[0])
               for p in load_prompts(args.dataset, args.data_dir, args.requests, args.seed)]
    rows = serving_bench(decoder.target, decoder.drafter, prompts, levels, decoder.block_size, args.max_new_tokens,
                         args.repeats, decoder.tree_budget)
    meta = {"command": " ".join(sys.argv), "machine": machine_description(), "drafter": decoder.drafter.name,
            "block_size": decoder.block_size, "tree_budget": decoder.tree_budget, "requests": len(prompts), "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats}
    print(report_serving(rows, Path(args.output), meta))
    return 0


def _export(args) -> int:
    from blockspec.export.convert import export_drafter
    from blockspec.targets.loading import load_target

    target = load_target(args.target) if args.target else None
    out = export_drafter(args.folder, args.format, args.output, target=target, verifier=args.verifier)
    print(f"{args.folder} -> {out} ({args.format} format)")
    return 0


def _import(args) -> int:
    from blockspec.export.convert import import_drafter
    from blockspec.targets.loading import load_target

    target = load_target(args.target) if args.target else None
    out = import_drafter(args.source, args.output, target=target)
    print(f"{args.source} -> {out} (blockspec / reference format)")
    return 0


def _bench(args) -> int:
    from pathlib import Path

    from blockspec.bench.runner import (DEFAULT_METHODS, machine_description,
                                        paired_comparisons, parse_methods, report, run_bench, summarize)
    from blockspec.drafters.registry import shipped_drafter_for
    from blockspec.targets.linear_kernels import describe_linear_kernels
    from blockspec.targets.loading import load_target

    if args.temperature < 0:
        raise BlockspecError(f"temperature must be >= 0, got {args.temperature}")
    if args.quick:
        args.temperature, args.limit = 0.0, min(args.limit, 2)
        args.max_new_tokens = min(args.max_new_tokens, 64)
        args.methods = args.methods or "baseline,hf-generate,prompt-lookup,dflash-b8,default"
    target = load_target(args.target, threads=args.threads)
    drafter = args.drafter
    if drafter == "auto":
        shipped = shipped_drafter_for(target)
        drafter = str(shipped) if shipped else None
    methods = parse_methods(args.methods or DEFAULT_METHODS, drafter, args.drafter_dtype)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    result = run_bench(target, methods, datasets, data_dir=args.data_dir, limit=args.limit,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                       repeats=args.repeats)
    meta = {"target": target.name, "drafter": drafter, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "seed": args.seed, "repeats": args.repeats, "command": " ".join(sys.argv),
            "machine": machine_description(), "linear_kernels": target.linear_kernels}
    rows = summarize(result, methods)
    meta["paired"] = paired_comparisons(rows, methods)
    from blockspec.bench.costs import measure_costs
    from blockspec.drafters.registry import load_drafter

    costs = {}
    for method in methods[1:]:
        if method.engine != "blockspec":
            continue
        costs[method.name] = measure_costs(target, load_drafter(method.drafter, target, dtype=method.drafter_dtype),
                                           method.block_size,
                                           verify_tokens=1 + method.tree_budget if method.tree_budget else None)
    for row in rows:
        cost = costs.get(row["method"])
        if cost and "d" in cost:
            row.update(r=cost["r"], d=cost["d"], predicted_speedup=row["tau"] / (cost["r"] + cost["d"]))
    meta["costs"] = costs
    from blockspec.bench.costs import roofline

    meta["roofline"] = roofline(target)
    baseline_rate = next((r["tokens_per_s"] for r in rows if r["method"] == "baseline"), None)
    print(f"memory bandwidth {meta['roofline']['bandwidth_gb_s']:.1f} GB/s, {meta['roofline']['bytes_per_step_mb']:.0f} MB "
          f"read per decode step -> plain decoding ceiling {meta['roofline']['ceiling_tokens_per_s']:.1f} tokens/s"
          + (f"; the baseline reached {baseline_rate:.1f} tokens/s" if baseline_rate else ""))
    print(describe_linear_kernels(target.linear_kernels))
    if not args.no_memory:
        from blockspec.bench.datasets import load_prompts
        from blockspec.bench.memory import measure_in_subprocess

        probe = load_prompts(datasets[0], args.data_dir, 1, args.seed)[0].turns[0]
        meta["peak_memory"] = [measure_in_subprocess(args.target, m.name, drafter, probe, args.max_new_tokens,
                                                     args.threads) for m in methods]
        for entry in meta["peak_memory"]:
            print(f"peak memory {entry}")
    report(rows, Path(args.output), meta)
    for name, cost in costs.items():
        if "d" in cost:
            print(f"{name}: decode(1) {cost['decode_s'] * 1e3:.1f} ms, verify({cost['verify_tokens']}) "
                  f"{cost['verify_s'] * 1e3:.1f} ms (r = {cost['r']:.2f}), draft {cost['draft_s'] * 1e3:.1f} ms "
                  f"(d = {cost['d']:.2f}); speedup ~ tau / (r + d)")
    if result.mismatches:
        print(f"blockspec: error: {len(result.mismatches)} outputs differ from the baseline at T=0", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
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
