"""The public face: a target + drafter pair that turns prompts into text, with stats."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.decoding.stats import GenerationStats
from blockspec.drafters.registry import load_drafter
from blockspec.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_TREE_BUDGET
from blockspec.errors import InvalidArgumentError
from blockspec.targets.loading import DEFAULT_TARGET, load_target




@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int = 0
    # per token: (log-probability under the target, [(id, log-probability)] of the top ones)
    logprobs: list | None = None

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.as_dict(),
                "finish_reason": self.finish_reason}


class SpecDecoder:
    def __init__(self, target, drafter=None, block_size: int | None = None, plan: bool = True,
                 tree_budget: int | None = None):
        """`block_size`: the most tokens (anchor + drafts) a step verifies (a tree: its most
        depth + 1); None: the drafter's limit, at most 16. `plan`: each step drafts as many
        tokens (a tree: as many nodes) as maximise expected tokens per second (the goodput
        planner, from this machine's measured verify and drafting costs and this sequence's
        acceptance), a plain step included; False: always a full block (or tree).
        `tree_budget`: verify token trees of at most this many nodes (DDTree) where the
        drafter gives per-position distributions; None: chains."""
        self.target = target
        self.drafter = drafter
        if block_size is None:
            limit = getattr(drafter, "max_block_size", None)
            block_size = min(DEFAULT_BLOCK_SIZE, limit) if limit else DEFAULT_BLOCK_SIZE
        self.engine = SpecEngine(target, drafter, block_size, adaptive=plan, tree_budget=tree_budget)
        self.notes = self.engine.notes  # what runs differently from what was asked (chains instead of trees)
        self._result: GenerationResult | None = None

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def tree_budget(self) -> int | None:
        """The most nodes of a step's token tree; None: chains."""
        return self.engine.tree_budget

    def generate(self, prompt, **options):
        """Generate from a prompt (a string, or a list of chat messages) -> GenerationResult.
        A list of prompts (strings or message lists) decodes them as a batch -> a list of
        results, in order (see `generate_batch`)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return self.generate_batch(prompt, **options)
        stream = self._run(prompt, **options)
        for _ in stream:
            pass
        return self._result

    def generate_batch(self, prompts: list, *, max_batch: int = 8, max_new_tokens: int = 128,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop: list[str] | None = None, raw: bool = False) -> list[GenerationResult]:
        """Decode many prompts together: up to `max_batch` at once, one target pass per step
        for all of them (batched speculative decoding), the next prompt joining as soon as
        one ends. Prompt i samples with seed + i. Targets whose attention the slot cache
        cannot hold (neither full nor sliding-window) decode the prompts one after the other
        instead. Same outputs as `generate` one by one (at
        T=0 up to the float rounding a batched pass can move)."""
        from blockspec.decoding.engine import serving_engine

        seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        engine, _ = serving_engine(self.target, self.drafter, self.block_size, max_batch, self.tree_budget)
        results: list[GenerationResult | None] = [None] * len(prompts)
        for index, (prompt, prompt_seed) in enumerate(zip(prompts, seeds)):
            if isinstance(prompt, str) and not prompt.strip() or isinstance(prompt, list) and not prompt:
                raise InvalidArgumentError(f"prompt {index} is empty")
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=prompt_seed)
            prompt_ids = self.target.encode_prompt(prompt, raw=raw)
            text = RowText(self.target, stop, len(prompt_ids))

            def on_done(stats, text=text, index=index):
                results[index] = text.finish(stats)

            text.row = engine.add(prompt_ids, max_new_tokens=max_new_tokens, params=params, on_chunk=text.on_chunk,
                                  on_done=on_done)
        engine.run()
        return results

    def stream(self, prompt, **options) -> Iterator[str]:
        """Yield text pieces as tokens are committed; never a partial stop string.
        After the iterator ends, `last_result` holds the full result."""
        yield from self._run(prompt, **options)

    @property
    def last_result(self) -> GenerationResult | None:
        return self._result

    def _run(self, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop: list[str] | None = None, raw: bool = False,
             stop_token_ids: tuple[int, ...] | None = None, logprobs: int | None = None) -> Iterator[str]:
        """`logprobs`: also record the target's log-probability of each token and of its
        `logprobs` best alternatives."""
        if isinstance(prompt, str) and not prompt.strip():
            raise InvalidArgumentError("the prompt is empty")
        if isinstance(prompt, list) and not prompt:
            raise InvalidArgumentError("the message list is empty")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        prompt_ids = self.target.encode_prompt(prompt, raw=raw)
        stats = GenerationStats(self.engine.block_size)
        eos = set(self.target.eos_token_ids if stop_token_ids is None else stop_token_ids)
        text_stream = TextStream(self.target, stop, eos)
        sink = [] if logprobs is not None else None
        chunks = self.engine.generate(prompt_ids, max_new_tokens=max_new_tokens, params=params,
                                      stop_token_ids=stop_token_ids, stats=stats, logprobs=sink,
                                      top_logprobs=logprobs or 0)
        try:
            for chunk in chunks:
                piece = text_stream.feed(chunk)
                if piece:
                    yield piece
                if text_stream.stopped:
                    break
        finally:
            chunks.close()  # stops the engine and finalises its timings
        piece = text_stream.flush()
        if piece:
            yield piece
        self._result = text_stream.result(stats, len(prompt_ids), sink)


class TextStream:
    """Committed token chunks -> text pieces that are final: a piece never ends inside a
    UTF-8 character or with the start of a stop string; a stop string ends the text
    (excluded) and the tokens (at the shortest prefix that produced it)."""

    def __init__(self, target, stops: list[str] | None, eos: set[int]):
        self.target, self.eos = target, eos
        self.stops = [s for s in (stops or []) if s]  # an empty stop string would end every text at once
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0  # characters already handed out
        self.finish_reason = "length"
        self.stopped = False  # a stop string was reached: feed no more

    def feed(self, chunk: list[int]) -> str:
        self.tokens.extend(chunk)
        self.text = self.target.decode(self.tokens)
        if chunk and chunk[-1] in self.eos:
            self.finish_reason = "stop"
        cut = _first_stop(self.text, self.stops)
        if cut is not None:
            self.text = self.text[:cut]
            self.tokens = _shortest_prefix_reaching(self.target, self.tokens, self.stops)
            self.finish_reason, self.stopped = "stop", True
            return self.flush()
        safe = len(self.text) - _held_back(self.text, self.stops)
        if safe > self.emitted:
            piece, self.emitted = self.text[self.emitted:safe], safe
            return piece
        return ""

    def flush(self) -> str:
        piece, self.emitted = self.text[self.emitted:], len(self.text)
        return piece

    def result(self, stats: GenerationStats, prompt_tokens: int, logprobs: list | None) -> GenerationResult:
        """The text so far as a result; `stats` counts the tokens kept (a stop string cuts some)."""
        stats.new_tokens = len(self.tokens)
        return GenerationResult(text=self.text, token_ids=self.tokens, stats=stats, finish_reason=self.finish_reason,
                                prompt_tokens=prompt_tokens,
                                logprobs=None if logprobs is None else logprobs[: len(self.tokens)])


class RowText:
    """The text of one row of a BatchedSpecEngine: pass `on_chunk` to `engine.add` and set
    `row` to the row it returns. Its committed chunks go through a TextStream, each final
    piece to `on_text`; a stop string cancels the row, so it leaves the batch at the next step."""

    def __init__(self, target, stops: list[str] | None, prompt_tokens: int, logprobs: list | None = None,
                 on_text: Callable[[str], None] | None = None):
        self.stream = TextStream(target, stops, set(target.eos_token_ids))
        self.prompt_tokens, self.logprobs, self.on_text = prompt_tokens, logprobs, on_text
        self.row = None

    def on_chunk(self, chunk: list[int]) -> None:
        if self.stream.stopped:
            return
        self._hand_out(self.stream.feed(chunk))
        if self.stream.stopped:
            self.row.cancelled = True

    def finish(self, stats: GenerationStats) -> GenerationResult:
        """The row ended: hand out the held-back rest, and the result."""
        self._hand_out(self.stream.flush())
        return self.stream.result(stats, self.prompt_tokens, self.logprobs)

    def _hand_out(self, piece: str) -> None:
        if piece and self.on_text is not None:
            self.on_text(piece)


def _first_stop(text: str, stops: list[str]) -> int | None:
    positions = [text.find(s) for s in stops if s in text]
    return min(positions) if positions else None


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` to hold back: an incomplete UTF-8 character,
    or a suffix that could still grow into a stop string."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                hold = max(hold, length)
                break
    return hold


def _shortest_prefix_reaching(target, tokens: list[int], stops: list[str]) -> list[int]:
    for end in range(1, len(tokens) + 1):
        if _first_stop(target.decode(tokens[:end]), stops) is not None:
            return tokens[:end]
    return tokens


def load(target: str = DEFAULT_TARGET, drafter: str | None = "hybrid", *, block_size: int | None = None,
         plan: bool = True, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
         trust_remote_code: bool = False, context_window: int | None = None,
         force_drafter: bool = False, tree_budget: int | None = DEFAULT_TREE_BUDGET,
         drafter_dtype: str = "auto") -> SpecDecoder:
    """Load a target and a drafter. `drafter`: 'hybrid' (the shipped drafter for this target
    with prompt lookup beside it), 'auto' (the shipped drafter, else prompt lookup), 'none'
    (or None), 'prompt-lookup', or a drafter folder. `block_size`, `plan` and `tree_budget`:
    SpecDecoder's (trees by default where the drafter can; None: chains). `drafter_dtype`:
    the precision a trained drafter computes in (`auto`: `targets.loading.drafter_dtype`)."""
    target_adapter = load_target(target, device=device, dtype=dtype, threads=threads,
                                 trust_remote_code=trust_remote_code)
    options = {"context_window": context_window} if context_window else {}
    options["dtype"] = drafter_dtype
    if force_drafter:
        options["force"] = True
    drafter_obj = load_drafter(drafter, target_adapter, **options)
    return SpecDecoder(target_adapter, drafter_obj, block_size, plan, tree_budget)
