"""Batched speculative decoding: ragged acceptance, continuous admission, compaction; every
row equals greedy decoding of its prompt alone, and at T > 0 the rows are distributed as
the target."""

from __future__ import annotations

import numpy as np
import pytest

from blockspec.decoding.batched_spec import BatchedSpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.errors import InvalidArgumentError
from conftest import assert_same_or_near_tie, hf_greedy, tiny_target
from test_lossless_greedy import make_drafter
from test_sampling_exact import BLOCK, NEW, PROMPT, VOCAB, assert_same_distribution, dflash, exact_joint

PROMPTS = [[7], [5, 17, 33, 2, 9, 40], [(i * 37 + 11) % 90 + 2 for i in range(23)], [60, 61, 62, 60, 61, 62, 60]]
EOS = (1,)


def collect(engine, prompt, max_new, **options):
    out = {"tokens": [], "stats": None}
    engine.add(prompt, max_new_tokens=max_new, stop_token_ids=EOS, on_chunk=out["tokens"].extend,
               on_done=lambda stats: out.__setitem__("stats", stats), **options)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "dflash", "dflash-reduced-vocab", "oracle", "draft-model",
                                  "mtp", "eagle3"])
def test_every_row_equals_greedy_decoding_alone(arch, kind):
    target = tiny_target(arch)
    references = [hf_greedy(target.model, p, 30, EOS) for p in PROMPTS]
    if kind == "oracle":  # an oracle knows one sequence: the others get its (wrong) drafts
        drafter = make_drafter(kind, target, PROMPTS[1], references[1])
    else:
        drafter = make_drafter(kind, target, PROMPTS[0], references[0])
    engine = BatchedSpecEngine(target, drafter, block_size=6, max_batch=3)
    outputs = [collect(engine, p, 30 - 4 * i) for i, p in enumerate(PROMPTS[:2])]
    engine.step()
    engine.step()  # two rows in flight, then two more arrive (one waits: max_batch 3)
    outputs += [collect(engine, p, 30 - 4 * (i + 2)) for i, p in enumerate(PROMPTS[2:])]
    engine.run()
    for i, (prompt, out, reference) in enumerate(zip(PROMPTS, outputs, references)):
        max_new = 30 - 4 * i
        assert_same_or_near_tie(target.model, prompt, out["tokens"], reference[:max_new])
        assert out["stats"] is not None and out["stats"].new_tokens == len(out["tokens"])
    assert engine.cache is None and not engine.busy


def test_compaction_keeps_outputs_and_shrinks_the_cache():
    target = tiny_target("llama")
    drafter = make_drafter("dflash", target, PROMPTS[0], None)  # random drafts: most slots become holes
    engine = BatchedSpecEngine(target, drafter, block_size=8, max_batch=4, adaptive=False, token_budget=None)
    outputs = [collect(engine, p, 60) for p in PROMPTS]
    widths = []
    while engine.busy:
        engine.step()
        if engine.cache is not None:
            widths.append(engine.valid.shape[1])
            assert engine.cache.get_seq_length() == engine.valid.shape[1]
    assert any(b < a for a, b in zip(widths, widths[1:]))  # compacted at least once
    for prompt, out in zip(PROMPTS, outputs):
        assert_same_or_near_tie(target.model, prompt, out["tokens"], hf_greedy(target.model, prompt, 60, EOS))


def test_sliding_window_targets_are_refused():
    with pytest.raises(InvalidArgumentError, match="full attention"):
        BatchedSpecEngine(tiny_target("gemma3"), None)


def test_cancelled_rows_leave_and_the_others_finish():
    target = tiny_target("qwen3")
    engine = BatchedSpecEngine(target, make_drafter("prompt-lookup", target, [], []), block_size=4)
    keep = collect(engine, PROMPTS[1], 20)
    engine.add(PROMPTS[2], max_new_tokens=200, stop_token_ids=(), on_chunk=lambda c: None, on_done=lambda s: None)
    engine.step()
    engine.rows[1].cancelled = True
    engine.run()
    assert_same_or_near_tie(target.model, PROMPTS[1], keep["tokens"], hf_greedy(target.model, PROMPTS[1], 20, EOS))


def test_rows_sampled_in_one_batch_are_distributed_as_the_target():
    target = tiny_target("llama", vocab_size=VOCAB, hidden=32, layers=2, seed=3)
    params = SamplingParams(temperature=1.0)
    engine = BatchedSpecEngine(target, dflash(target, sample_drafts=True), block_size=BLOCK, max_batch=100)
    results = []
    for i in range(3000):
        out = []
        engine.add(PROMPT, max_new_tokens=NEW, stop_token_ids=(), on_chunk=out.extend, on_done=lambda s: None,
                   params=SamplingParams(params.temperature, seed=5000 + i))
        results.append(out)
        if len(engine.waiting) == 100:
            engine.run()
    engine.run()
    counts = np.zeros((VOCAB, VOCAB, VOCAB))
    for out in results:
        counts[tuple(out[1:])] += 1
    assert_same_distribution(counts, exact_joint(target, params))


def test_serving_bench_closed_loop_counts_every_token(tmp_path):
    from blockspec.bench.serving import report_serving, serving_bench

    target = tiny_target("llama")
    drafter = make_drafter("prompt-lookup", target, [], [])
    rows = serving_bench(target, drafter, PROMPTS, [1, 3], block_size=4, max_new_tokens=10, repeats=2)
    assert [(r["concurrency"], r["method"]) for r in rows] == [(1, "baseline"), (1, "speculative"),
                                                               (3, "baseline"), (3, "speculative")]
    for r in rows:
        assert r["requests"] == len(PROMPTS) and 0 < r["output_tokens"] <= 10 * len(PROMPTS)
        assert len(r["tokens_per_s_runs"]) == 2 and min(r["tokens_per_s_runs"]) <= r["tokens_per_s"]
    # lossless at T=0: both methods emit the same number of tokens
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"]
    report_serving(rows, tmp_path, {})
    assert (tmp_path / "serving.png").stat().st_size > 0 and "speculative" in (tmp_path / "serving.md").read_text()


@pytest.mark.parametrize("plain_seconds, retry_every", [(1.0, 16), (1.8, 4)], ids=["clear", "close"])
def test_mode_chooser_tries_both_then_runs_the_faster_and_re_tries_the_other(plain_seconds, retry_every):
    from blockspec.decoding.batched_spec import ModeChooser

    chooser = ModeChooser(warmup=2, explore_every=4, margin=0.15)
    seconds = {True: 2.0, False: plain_seconds}  # plain steps are faster at batch 4: 2x (clear) or 1.1x (close)
    picks = []
    for _ in range(40):
        drafting = chooser.choose(4)
        picks.append(drafting)
        chooser.record(4, drafting, tokens=10, seconds=seconds[drafting])
    assert picks[:4] == [True, True, False, False]  # warm-up: each mode twice
    # then plain steps, with a re-try of drafting every 4 steps, or every 16 once plain is clearly faster
    assert [step for step, drafting in enumerate(picks, 1) if drafting and step > 4] == \
        [step for step in range(5, 41) if step % retry_every == 0]
    assert chooser.choose(1) is True  # another batch size is measured on its own


class ScriptedChooser:
    """Drafting on the first step and from step `resume` on, plain in between (records nothing)."""

    def __init__(self, resume):
        self.resume, self.step = resume, 0

    def choose(self, batch):
        self.step += 1
        return self.step == 1 or self.step >= self.resume

    def record(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("kind", ["dflash", "mtp", "draft-model", "oracle", "eagle3"])
def test_plain_steps_defer_the_drafter_and_outputs_stay_greedy(kind):
    target = tiny_target("llama")
    references = [hf_greedy(target.model, p, 30, EOS) for p in PROMPTS]
    drafter = make_drafter(kind, target, PROMPTS[1], references[1])
    calls = {"accept": 0, "propose": 0}
    originals = type(drafter).accept, type(drafter).propose

    class Spy(type(drafter)):
        def accept(self, *args):
            calls["accept"] += 1
            return originals[0](self, *args)

        def propose(self, *args):
            calls["propose"] += 1
            return originals[1](self, *args)

    drafter.__class__ = Spy
    engine = BatchedSpecEngine(target, drafter, block_size=5, max_batch=4,
                               mode_chooser=ScriptedChooser(resume=20))
    outputs = [collect(engine, p, 30) for p in PROMPTS]
    for _ in range(8):  # one drafting step, then plain ones: the drafters are not called
        engine.step()
    proposals_after_first_step = calls["propose"]
    assert calls["accept"] == 0 and proposals_after_first_step <= len(PROMPTS)
    engine.run()  # drafting again from step 20 (rows that accepted nothing re-probe after 16 idle steps)
    assert calls["propose"] > proposals_after_first_step
    assert calls["accept"] <= calls["propose"]  # one catch-up per drafting row at most
    for prompt, out, reference in zip(PROMPTS, outputs, references):
        assert_same_or_near_tie(target.model, prompt, out["tokens"], reference)
