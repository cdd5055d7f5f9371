"""`train --train-head`: a DFlash drafter whose draft-vocabulary head rows are its own weights
(started from the target's rows, trained with the layers) instead of the target's frozen head."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockspec.drafters.dflash import DFlashDraftModel, DFlashDrafter
from blockspec.errors import InvalidArgumentError
from blockspec.export.convert import export_drafter, import_drafter
from blockspec.training.methods.dflash import DFlashMethod
from blockspec.training.methods.eagle3 import Eagle3Method
from blockspec.training.trainer import Trainer
from conftest import tiny_target
from test_training import one_record, small_config


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def warm(target, tmp_path_factory):
    """A drafter trained with the borrowed head over 24 draft tokens."""
    folder = tmp_path_factory.mktemp("warm")
    trainer = Trainer(small_config(folder, draft_vocab_size=24, epochs=2), target, DFlashMethod(),
                      [one_record(target)])
    trainer.run()
    return folder / "run" / "final"


def test_a_trained_head_starts_as_the_targets_rows_and_drafts_exactly_as_the_borrowed_head(target, warm):
    trainer = Trainer(small_config(warm.parent / "t1", draft_vocab_size=24, init_from=str(warm),
                                   keep_init_vocabulary=True, train_head=True),
                      target, DFlashMethod(), [one_record(target)])
    own = trainer.model.own_head()
    assert own is not None and own.weight.requires_grad
    torch.testing.assert_close(own.weight, target.lm_head.weight[trainer.model.d2t])
    layers_group, head_group = trainer.optimizer.param_groups  # the head steps at head_lr_scale x lr
    assert head_group["params"] == [own.weight] and head_group["lr"] == pytest.approx(0.1 * trainer.config.lr)
    assert not any(p is own.weight for p in layers_group["params"])
    borrowed = DFlashDrafter(DFlashDraftModel.from_pretrained(warm), target)
    mine = DFlashDrafter(trainer.model, target)
    hidden = torch.randn(5, target.hidden_size)
    torch.testing.assert_close(mine.head_logits(hidden), borrowed.head_logits(hidden))


def test_a_trained_head_learns_leaves_the_target_alone_and_round_trips(target, warm, tmp_path):
    target_head = target.lm_head.weight.detach().clone()
    trainer = Trainer(small_config(tmp_path, draft_vocab_size=24, init_from=str(warm), keep_init_vocabulary=True,
                                   train_head=True, epochs=20),
                      target, DFlashMethod(), [one_record(target)])
    start = trainer.model.own_head().weight.detach().clone()
    final = trainer.run()
    assert not torch.equal(trainer.model.own_head().weight, start)  # it trained
    assert torch.equal(target.lm_head.weight, target_head)  # the target's head did not
    config = json.loads((final / "config.json").read_text())
    assert config["trained_lm_head"] is True
    loaded = DFlashDraftModel.from_pretrained(final)
    assert loaded.config.trained_head and loaded.stored_head is None
    torch.testing.assert_close(loaded.own_head().weight, trainer.model.own_head().weight)
    torch.testing.assert_close(load_file(final / "model.safetensors")["lm_head.weight"],
                               trainer.model.own_head().weight)
    # the engine drafts through it, not through the target's rows
    drafter = DFlashDrafter(loaded, target)
    hidden = torch.randn(3, target.hidden_size)
    torch.testing.assert_close(drafter.head_logits(hidden), hidden @ loaded.own_head().weight.T)

    # a warm start from it keeps its rows where the vocabularies share a token; others start as the target's
    record = {"prompt_ids": [3, 4], "response_ids": [11, 12, 11, 13] * 5}
    again = Trainer(small_config(tmp_path / "again", draft_vocab_size=24, init_from=str(final), train_head=True),
                    target, DFlashMethod(), [record])
    old_row = {int(t): row for t, row in zip(loaded.d2t, loaded.own_head().weight)}
    for token, row in zip(again.model.d2t.tolist(), again.model.own_head().weight):
        torch.testing.assert_close(row, old_row.get(token, target.lm_head.weight[token]))
    assert set(again.model.d2t.tolist()) != set(old_row)  # the data's tokens came in: both cases ran

    # export to speculators carries the trained rows, and import brings them back as a trained head
    export_drafter(final, "speculators", tmp_path / "spec", target=target)
    spec = load_file(tmp_path / "spec" / "model.safetensors")
    torch.testing.assert_close(spec["lm_head.weight"], loaded.own_head().weight)
    import_drafter(tmp_path / "spec", tmp_path / "back")
    back = DFlashDraftModel.from_pretrained(tmp_path / "back")
    assert back.config == loaded.config
    torch.testing.assert_close(back.own_head().weight, loaded.own_head().weight)
    with pytest.raises(InvalidArgumentError, match="trained head"):
        export_drafter(final, "transformers", tmp_path / "hf", target=target)
    with pytest.raises(InvalidArgumentError, match="pass --train-head true"):
        Trainer(small_config(tmp_path / "borrow", draft_vocab_size=24, init_from=str(final)), target, DFlashMethod(),
                [record])


def test_train_head_is_refused_where_it_cannot_apply(target, tmp_path):
    with pytest.raises(InvalidArgumentError, match="train_head needs --draft-vocab-size"):
        Trainer(small_config(tmp_path / "a", train_head=True), target, DFlashMethod(), [one_record(target)])
    with pytest.raises(InvalidArgumentError, match="train_head does not apply to --method eagle3"):
        Trainer(small_config(tmp_path / "b", method="eagle3", train_head=True, draft_vocab_size=24), target,
                Eagle3Method(), [one_record(target)])
