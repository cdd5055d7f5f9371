"""What a user would run instead of blockspec: transformers' own `generate`, plain, with
its prompt lookup, and with its built-in DFlash path fed with OUR drafter's weights
(exported to its `muse_glimmer_assistant` format). Each looks like a `SpecDecoder` to
the bench runner: `generate(...)` returns text, tokens and timing stats.

Fairness: the same target object, the same prompt tokens, the same EOS ids and no
logits processor besides temperature (top-k / top-p from the model's generation
config are switched off). Time to first token is taken from a streamer (the first
put after the prompt); decode time is the rest. Verify steps are the target's forward
calls after the prefill, counted with a hook.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from blockspec.decoding.stats import GenerationStats
from blockspec.pipeline import GenerationResult

PEER_KINDS = ("hf-generate", "hf-prompt-lookup", "hf-dflash")


class _FirstTokenClock(BaseStreamer):
    def __init__(self):
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:  # call 1 is the prompt
            self.first_token_at = time.perf_counter()

    def end(self):
        pass


class TransformersPeer:
    def __init__(self, target, kind: str, drafter_folder: str | None = None, block_size: int = 16,
                 prompt_lookup_tokens: int = 8):
        if kind not in PEER_KINDS:
            raise ValueError(f"unknown peer {kind!r}: one of {PEER_KINDS}")
        self.target, self.kind = target, kind
        self.block_size = 1
        self.assistant = None
        self.prompt_lookup_tokens = prompt_lookup_tokens
        if kind == "hf-dflash":
            from transformers import MuseGlimmerAssistantModel

            from blockspec.export.convert import export_drafter

            self._export_dir = tempfile.TemporaryDirectory(prefix="blockspec-hf-dflash-")
            folder = Path(self._export_dir.name) / "drafter"
            export_drafter(drafter_folder, "transformers", folder, target=target)
            self.assistant = MuseGlimmerAssistantModel.from_pretrained(folder, dtype=target.dtype).eval()
            self.assistant.config.block_size = block_size
            self.block_size = block_size
        self._forwards = 0
        target.model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self._forwards += 1

    @torch.inference_mode()
    def generate(self, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                 **_) -> GenerationResult:
        target = self.target
        ids = target.encode_prompt(prompt)
        eos = list(target.eos_token_ids)
        options = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0], top_k=None, top_p=None,
                       do_sample=temperature > 0, temperature=temperature if temperature > 0 else None)
        if self.kind == "hf-prompt-lookup":
            options["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        if self.kind == "hf-dflash":
            options["speculation_type"] = "dflash"
        config = GenerationConfig(**options)
        torch.manual_seed(seed)
        clock = _FirstTokenClock()
        input_ids = torch.tensor([ids], device=target.device)
        self._forwards = 0
        started = time.perf_counter()
        out = target.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=config, assistant_model=self.assistant, streamer=clock)
        finished = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        stats = GenerationStats(1)
        stats.new_tokens = len(tokens)
        first = clock.first_token_at or finished
        stats.ttft_s, stats.decode_s, stats.total_s = first - started, finished - first, finished - started
        # forward calls after the prefill; transformers' assisted loop may run a final
        # forward whose result it does not use, so tau here is a lower bound
        stats.steps = max(self._forwards - 1, 0)
        stats.accept_hist = []
        return GenerationResult(text=target.decode(tokens), token_ids=tokens, stats=stats,
                                finish_reason="stop" if tokens and tokens[-1] in eos else "length")
