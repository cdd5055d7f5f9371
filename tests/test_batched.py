"""The lean batched decoder (data regeneration) and the in-place KV cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from blockspec.errors import InvalidArgumentError
from blockspec.targets.cache import GrowingLayer, new_cache
from blockspec.training.data import read_sources
from blockspec.training.regenerate import generate_batch
from conftest import ARCHITECTURES, assert_same_or_near_tie, hf_greedy, tiny_model

PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41, 8, 2, 17, 30, 11, 12], [60], [21, 22, 23, 24, 25, 26]]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_row_equals_greedy_decoding_of_its_prompt_alone(arch):
    model = tiny_model(arch)
    eos = (1, 4)  # two EOS ids: rows end at different steps and leave the batch
    responses = generate_batch(model, PROMPTS, max_new_tokens=20, eos_token_ids=eos)
    assert len(responses) == len(PROMPTS)
    for prompt, response in zip(PROMPTS, responses):
        reference = hf_greedy(model, prompt, 20, eos)
        assert_same_or_near_tie(model, prompt, response, reference)
        assert len(response) <= 20
        assert all(t not in eos for t in response[:-1])


def test_rows_end_at_their_own_eos():
    model = tiny_model("llama")
    free = generate_batch(model, PROMPTS, max_new_tokens=12, eos_token_ids=())
    # make the third token of row 1 an EOS: that row must stop there, the others go on
    eos_id = free[1][2]
    if eos_id in free[1][:2]:
        pytest.skip("the chosen token also occurs earlier in the row")
    ended = generate_batch(model, PROMPTS, max_new_tokens=12, eos_token_ids=(eos_id,))
    assert ended[1] == free[1][:3]
    for row in (0, 2, 3):
        cut = next((i + 1 for i, t in enumerate(free[row]) if t == eos_id), 12)
        assert ended[row] == free[row][:cut]


def test_features_are_the_target_hidden_states_of_every_token_it_ran():
    model = tiny_model("qwen3")
    layers = [0, 2, 3]
    responses, features, top = generate_batch(model, PROMPTS, 10, (1,), feature_layers=layers)
    assert top is None
    for prompt, response, stored in zip(PROMPTS, responses, features):
        with torch.inference_mode():
            out = model(torch.tensor([prompt + response]), output_hidden_states=True)
        reference = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)[0, :-1]
        assert stored.dtype == torch.float16
        assert stored.shape == reference.shape  # the last token was never fed back
        torch.testing.assert_close(stored.float(), reference, atol=2e-2, rtol=1e-2)


def test_top_k_is_the_distribution_each_response_token_was_chosen_from():
    model = tiny_model("llama")
    responses, features, top = generate_batch(model, PROMPTS, 10, (1,), top_k=4)
    assert features is None
    for prompt, response, (ids, probs) in zip(PROMPTS, responses, top):
        assert ids.dtype == torch.int32 and probs.dtype == torch.float16 and ids.shape == (len(response), 4)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        reference = torch.softmax(logits.float(), dim=-1).topk(4, dim=-1)
        torch.testing.assert_close(probs.float(), reference.values, atol=2e-3, rtol=1e-2)
        assert ids[:, 0].tolist() == response  # greedy: each token is its distribution's top


def test_sampling_is_seeded():
    model = tiny_model("llama")
    first = generate_batch(model, PROMPTS, 8, (1,), temperature=1.0, generator=torch.Generator().manual_seed(3))
    again = generate_batch(model, PROMPTS, 8, (1,), temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert first == again


def test_bad_arguments():
    model = tiny_model("llama")
    assert generate_batch(model, [], 4, (1,)) == []
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(model, [[3], []], 4, (1,))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_batch(model, [[3]], 0, (1,))


def test_growing_cache_matches_the_stock_cache_through_growth_rollback_and_row_selection():
    model = tiny_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(2, 90, (3, 300))  # past the initial capacity of 256
    ours, stock = new_cache(model.config), DynamicCache(config=model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in ours.layers)
    with torch.inference_mode():
        for cache in (ours, stock):
            model(ids[:, :200], past_key_values=cache, use_cache=True)
            model(ids[:, 200:280], past_key_values=cache, use_cache=True)
            cache.crop(-30)  # roll back 30 tokens
            cache.batch_select_indices(torch.tensor([0, 2]))
        assert ours.get_seq_length() == stock.get_seq_length() == 250
        a = model(ids[[0, 2], 250:], past_key_values=ours, use_cache=True).logits
        b = model(ids[[0, 2], 250:], past_key_values=stock, use_cache=True).logits
    torch.testing.assert_close(a, b)
    for mine, theirs in zip(ours.layers, stock.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)


def test_prompt_sources_slices_and_shipped_lists(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(10)))
    assert read_sources([f"{path}[2:5]"]) == ["q2", "q3", "q4"]
    assert read_sources([f"{path}[8:]", f"{path}[:1]"]) == ["q8", "q9", "q0"]
    assert read_sources([str(path)], limit=2) == ["q0", "q1"]
    coding = read_sources(["builtin:coding_tasks"])
    everyday = read_sources(["builtin:everyday_questions"])
    assert len(coding) == len(set(coding)) == 400 and len(everyday) == len(set(everyday)) == 400
    with pytest.raises(InvalidArgumentError, match="unknown prompt list"):
        read_sources(["builtin:nope"])
    with pytest.raises(InvalidArgumentError, match="no prompts"):
        read_sources([f"{path}[20:30]"])


def test_python_function_prompts_are_humaneval_style_and_sliced_disjointly(tmp_path):
    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    (package / "maths.py").write_text(
        "import functools\n\n"
        "@functools.cache\n"
        "def add_all(values: list[int], start: int = 0) -> int:\n"
        '    """Return the sum of every value in `values`, counted from `start` upward."""\n'
        "    return start + sum(values)\n\n"
        "def _private(x):\n"
        '    """A private helper is not a prompt, however long its docstring is."""\n\n'
        "def short(x):\n"
        '    """Too short."""\n\n'
        "class Box:\n"
        "    def method(self):\n"
        '        """Methods need their class to make sense, so they are left out."""\n')
    (package / "tests" / "test_maths.py").write_text(
        'def test_add_all():\n    """A test suite reads nothing like a library function."""\n')
    (package / "broken.py").write_text("def (:\n")  # unparsable files are skipped
    prompts = read_sources([f"python-functions:{package}"])
    assert prompts == ['def add_all(values: list[int], start: int=0) -> int:\n'
                       '    """Return the sum of every value in `values`, counted from `start` upward."""\n']
    stdlib = read_sources(["python-functions:stdlib"])
    assert len(stdlib) == len(set(stdlib)) > 500
    assert all(p.startswith(("def ", "async def ")) and '"""' in p for p in stdlib)
    assert read_sources(["python-functions:stdlib[0:5]"]) + read_sources(["python-functions:stdlib[5:9]"]) \
        == stdlib[:9]
    with pytest.raises(InvalidArgumentError, match="not a folder"):
        read_sources([f"python-functions:{tmp_path / 'missing'}"])
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "constants.py").write_text("LIMIT = 3\n")
    with pytest.raises(InvalidArgumentError, match="no public function"):
        read_sources([f"python-functions:{tmp_path / 'bare'}"])
