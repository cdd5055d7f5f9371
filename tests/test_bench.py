"""The benchmark harness: loaders on the shared files, the speedup arithmetic, an end-to-end run."""

from __future__ import annotations

import json

import pytest

from blockspec.bench import runner
from blockspec.bench.datasets import MATH_SUFFIX, load_prompts
from blockspec.bench.runner import BenchResult, Method, Sample, report, run_bench, summarize
from conftest import DATA_DIR

needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"public eval data not at {DATA_DIR}")


@needs_data
def test_loaders_read_the_shared_files():
    gsm8k = load_prompts("gsm8k", str(DATA_DIR), limit=3, seed=1)
    assert len(gsm8k) == 3 and gsm8k[0].turns[0].endswith(MATH_SUFFIX)
    assert [p.prompt_id for p in gsm8k] == [p.prompt_id for p in load_prompts("gsm8k", str(DATA_DIR), 3, seed=1)]
    assert len(load_prompts("math500", str(DATA_DIR))) == 500
    mt = load_prompts("mt_bench", str(DATA_DIR))
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    humaneval = load_prompts("humaneval", limit=2)
    assert "def " in humaneval[0].turns[0]


def sample(decode_s, new_tokens, steps, hist, ids=((1, 2),)):
    return Sample([list(i) for i in ids], new_tokens, decode_s, 0.1, steps, hist, decode_s + 0.1)


def test_speedup_is_the_ratio_of_time_per_output_token():
    methods = [Method("baseline", "none", 1), Method("fast", "x", 4)]
    result = BenchResult(samples={
        ("baseline", "d"): [sample(9.0, 10, 9, [9, 0, 0, 0]), sample(4.0, 5, 4, [4, 0, 0, 0])],
        ("fast", "d"): [sample(3.0, 10, 3, [0, 0, 0, 3]), sample(2.0, 5, 2, [0, 2, 0, 0])],
    })
    rows = {r["method"]: r for r in summarize(result, methods)}
    assert rows["baseline"]["speedup_median"] == 1.0
    assert rows["fast"]["speedup_median"] == pytest.approx((3.0 + 2.0) / 2)  # median of 3x and 2x
    assert rows["fast"]["tau"] == pytest.approx((9 + 4) / (3 + 2))
    assert rows["fast"]["accept_by_pos"] == [1.0, 0.6, 0.6]
    assert rows["fast"]["agreement"] == 1.0  # the same tokens as the baseline


@pytest.mark.real
@needs_data
def test_end_to_end_on_two_prompts_flags_an_injected_mismatch(tmp_path, monkeypatch):
    from blockspec.targets.loading import load_target

    target = load_target("default")
    methods = [Method("baseline", "none", 1), Method("prompt-lookup", "prompt-lookup", 8)]
    result = run_bench(target, methods, ["gsm8k"], data_dir=str(DATA_DIR), limit=2, max_new_tokens=16)
    assert not result.mismatches
    report(summarize(result, methods), tmp_path, {"test": True})
    assert json.loads((tmp_path / "results.json").read_text())["rows"]
    assert (tmp_path / "table.md").read_text().startswith("| method")
    assert (tmp_path / "bench.png").stat().st_size > 0

    real_run_prompt = runner.run_prompt

    def corrupt(decoder, prompt, *args):
        out = real_run_prompt(decoder, prompt, *args)
        if decoder.drafter is not None:
            out.token_ids[0][-1] += 1
        return out

    monkeypatch.setattr(runner, "run_prompt", corrupt)
    broken = run_bench(target, methods, ["gsm8k"], data_dir=str(DATA_DIR), limit=1, max_new_tokens=8)
    assert broken.mismatches and broken.mismatches[0][0] == "prompt-lookup"


def test_repeats_keep_each_methods_run_of_median_time_and_rotate_the_order(tmp_path, monkeypatch):
    """--repeats N: every method runs N rounds per prompt, in a rotating order; each keeps its run
    of median time per token, so one slow run moves no ratio; a mismatch in any round is flagged."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    methods = [Method("baseline", "none", 1), Method("fast", "x", 4)]
    monkeypatch.setattr(Method, "build", lambda self, target: self.name)
    # per (method, prompt): the seconds of each round, one of them an outlier
    seconds = {("baseline", "a"): [4.0, 40.0, 5.0], ("fast", "a"): [2.0, 2.5, 30.0],
               ("baseline", "b"): [8.0, 9.0, 7.0], ("fast", "b"): [4.0, 3.0, 50.0]}
    calls = []

    def fake_run(decoder, prompt, *args):
        calls.append((decoder, prompt.turns[0]))
        decode_s = seconds[(decoder, prompt.turns[0])].pop(0)
        wrong = decoder == "fast" and prompt.turns[0] == "b" and not seconds[("fast", "b")]  # its last round
        return sample(decode_s, 11, 10, [10, 0, 0, 0], ids=((1, 3),) if wrong else ((1, 2),))

    monkeypatch.setattr(runner, "run_prompt", fake_run)
    result = run_bench(None, methods, [str(prompts)], data_dir=None, limit=None, max_new_tokens=8, repeats=3)
    assert len(calls) == 12 and [c[0] for c in calls[:6]] == ["baseline", "fast", "fast", "baseline", "baseline", "fast"]
    assert [s.decode_s for s in result.samples[("baseline", str(prompts))]] == [5.0, 8.0]
    assert [s.decode_s for s in result.samples[("fast", str(prompts))]] == [2.5, 4.0]
    rows = {r["method"]: r for r in summarize(result, methods)}
    assert rows["fast"]["speedup_median"] == pytest.approx((5.0 / 2.5 + 8.0 / 4.0) / 2)
    assert result.mismatches == [("fast", str(prompts), "1", 0)]


def test_method_names_parse_into_the_registry():
    from blockspec.bench.runner import parse_methods
    from blockspec.errors import InvalidArgumentError

    methods = parse_methods("baseline,prompt-lookup,dflash-b4,hf-generate,hf-prompt-lookup,hf-dflash-b16", "/drafter")
    assert [(m.name, m.drafter, m.block_size, m.engine) for m in methods] == [
        ("baseline", "none", 1, "blockspec"), ("prompt-lookup", "prompt-lookup", 8, "blockspec"),
        ("dflash-b4", "/drafter", 4, "blockspec"), ("hf-generate", "none", 1, "hf-generate"),
        ("hf-prompt-lookup", "none", 1, "hf-prompt-lookup"), ("hf-dflash-b16", "/drafter", 16, "hf-dflash")]
    assert [m.name for m in parse_methods("baseline,dflash-b8", None)] == ["baseline"]  # no drafter: skipped
    lossy = parse_methods("baseline,diffusion-b8-s2,diffusion-b4", "/drafter")[1:]
    assert [(m.engine, m.block_size, m.diffusion_steps, m.lossless) for m in lossy] == [
        ("diffusion", 8, 2, False), ("diffusion", 4, 1, False)]
    custom = parse_methods("baseline,mtp-b4=/runs/mtp", None)[1]
    assert (custom.name, custom.drafter, custom.block_size, custom.engine) == ("mtp-b4", "/runs/mtp", 4, "blockspec")
    trees = parse_methods("baseline,default,default-chain,dflash-tree,dflash-tree-n12", "/drafter")[1:]
    assert [(m.name, m.drafter, m.plan, m.tree_budget) for m in trees] == [
        ("default", "hybrid:/drafter", True, 32), ("default-chain", "hybrid:/drafter", True, None),
        ("dflash-tree", "/drafter", True, 32), ("dflash-tree-n12", "/drafter", False, 12)]
    assert [m.name for m in parse_methods("baseline,dflash-tree,dflash-tree-n8", None)] == ["baseline"]
    # the default command with another drafter, beside the shipped one in the same run
    others = parse_methods("baseline,default,default-new=/other,default-chain-new=/other", "auto")[1:]
    assert [(m.name, m.drafter, m.plan, m.tree_budget, m.block_size) for m in others] == [
        ("default", "hybrid", True, 32, 16), ("default-new", "hybrid:/other", True, 32, 16),
        ("default-chain-new", "hybrid:/other", True, None, 16)]
    with pytest.raises(InvalidArgumentError, match="named twice: default "):
        parse_methods("baseline,default,default=/other", "auto")
    for drafter in ("/drafter", None):  # a bad budget is an error even where the method would be skipped
        with pytest.raises(InvalidArgumentError, match="node budget"):
            parse_methods("baseline,dflash-tree-n0", drafter)
    with pytest.raises(InvalidArgumentError, match="unknown bench method"):
        parse_methods("baseline,medusa", None)
    with pytest.raises(InvalidArgumentError, match="first bench method"):
        parse_methods("prompt-lookup,baseline", None)
    # `@DTYPE`: the same method with its drafter in another precision, side by side
    precisions = parse_methods("baseline,default,default@float32,dflash-b8@bfloat16", "/drafter", "auto")[1:]
    assert [(m.name, m.drafter, m.tree_budget, m.drafter_dtype) for m in precisions] == [
        ("default", "hybrid:/drafter", 32, "auto"), ("default@float32", "hybrid:/drafter", 32, "float32"),
        ("dflash-b8@bfloat16", "/drafter", None, "bfloat16")]
    assert parse_methods("baseline,prompt-lookup", None, "float32")[1].drafter_dtype == "float32"
    with pytest.raises(InvalidArgumentError, match="precision must be one of"):
        parse_methods("baseline,default@int8", "/drafter")
    with pytest.raises(InvalidArgumentError, match="transformers peer"):
        parse_methods("baseline,hf-dflash-b8@bfloat16", "/drafter")


@pytest.mark.real
@needs_data
def test_transformers_peers_run_interleaved_and_match_the_baseline():
    from blockspec.bench.runner import parse_methods
    from blockspec.drafters.registry import shipped_drafter_for
    from blockspec.targets.loading import load_target

    target = load_target("default")
    methods = parse_methods("baseline,hf-generate,hf-prompt-lookup,hf-dflash-b8", str(shipped_drafter_for(target)))
    result = run_bench(target, methods, ["gsm8k"], data_dir=str(DATA_DIR), limit=1, max_new_tokens=24)
    assert not result.mismatches  # transformers' three paths give the baseline's tokens at T=0
    rows = {r["method"]: r for r in summarize(result, methods)}
    assert rows["hf-generate"]["tau"] == pytest.approx(1.0)
    for name in ("hf-prompt-lookup", "hf-dflash-b8"):
        assert rows[name]["tau"] >= 1.0 and rows[name]["speedup_median"] > 0


def test_final_answers_and_accuracy():
    from blockspec.bench.datasets import final_answer, same_answer

    assert final_answer("so it is \\boxed{\\frac{3}{4}}.") == "\\frac{3}{4}"
    assert final_answer("She pays 1,200 dollars, then 18.") == "18"
    assert same_answer("1,200", "1200") and same_answer("18.0", "18") and not same_answer("17", "18")
    assert not same_answer(None, "3")


def test_paired_comparison_cancels_the_spread_between_prompts(tmp_path):
    """Prompts differ 4x in speed; the subject is 10% faster than `other` on every one of them:
    the medians overlap, the paired ratio says 1.10 with a tight interval."""
    methods = [Method("baseline", "none", 1), Method("subject", "x", 4), Method("other", "y", 4)]
    base, subject, other = [], [], []
    for prompt, speed in enumerate([1.0, 4.0, 2.0, 0.5, 3.0, 1.5]):
        base.append(sample(8.0, 9, 8, [8, 0, 0, 0]))
        other.append(sample(8.0 / speed, 9, 4, [0, 4, 0, 0]))
        subject.append(sample(8.0 / speed / 1.1, 9, 4, [0, 4, 0, 0]))
    result = BenchResult(samples={("baseline", "d"): base, ("subject", "d"): subject, ("other", "d"): other,
                                  ("baseline", "e"): base[:3], ("subject", "e"): other[:3], ("other", "e"): other[:3]})
    rows = summarize(result, methods)
    comparisons = {(c["against"], c["dataset"]): c for c in runner.paired_comparisons(rows, methods)}
    assert set(comparisons) == {("other", "d"), ("other", "e"), ("other", "all")}
    on_d = comparisons[("other", "d")]
    assert on_d["ratio"] == pytest.approx(1.1) and on_d["ci95"] == pytest.approx([1.1, 1.1])
    assert comparisons[("other", "e")]["ratio"] == pytest.approx(1.0)  # the same samples: a tie
    pooled = comparisons[("other", "all")]
    assert pooled["prompts"] == 9 and 1.0 < pooled["ci95"][0] < pooled["ratio"] < pooled["ci95"][1] < 1.1
    assert runner.paired_comparisons(rows, methods[:2]) == []  # nothing to compare with
    kernels = {"kernels": {2: "weight-first", 1: "onednn"}, "source": "measured"}
    report(rows, tmp_path, {"paired": list(comparisons.values()), "linear_kernels": kernels})
    table = (tmp_path / "table.md").read_text()
    assert "| subject | other | d | 6 | 1.10x | 1.10-1.10 |" in table
    assert "Target Linear kernels by rows in the pass (measured): 1: onednn, 2: weight-first." in table
    assert json.loads((tmp_path / "results.json").read_text())["rows"][1]["speedup_by_prompt"]


def test_cost_decomposition_times_the_model_pass_of_a_hybrid_drafter():
    """`measure_costs` times one drafting pass of the MODEL for the default's hybrid drafter
    (the model + prompt lookup): the timed context repeats itself, and left to choose, the
    hybrid drafts those steps by lookup, which costs nothing and read d = 0.00."""
    import torch

    from blockspec.bench.costs import measure_costs
    from blockspec.decoding.draft import Draft, Drafter
    from blockspec.drafters.hybrid import HybridDrafter
    from conftest import tiny_target

    class Counted(Drafter):
        name = "counted"
        passes = 0

        def begin(self, prompt_ids, prompt_features):
            pass

        def propose_one(self, request):
            Counted.passes += 1
            return Draft(tokens=torch.full((request.num_drafts,), 3))

    target = tiny_target("llama")
    cost = measure_costs(target, HybridDrafter(Counted()), block_size=4, context_len=16, repeats=5)
    assert Counted.passes == 5 and cost["d"] > 0 and cost["r"] > 0
