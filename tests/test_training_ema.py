"""`train --ema-decay D`: checkpoints hold an exponential moving average of the drafter's
weights (what evaluation measures and `final` ships); the live weights resume exactly."""

from __future__ import annotations

import pytest
import torch

from blockspec.decoding.engine import SpecEngine
from blockspec.drafters.dflash import DFlashDraftModel, DFlashDrafter
from blockspec.errors import InvalidArgumentError
from blockspec.training.methods.dflash import DFlashMethod
from blockspec.training.trainer import Trainer, check_config
from conftest import hf_greedy, tiny_target
from test_training import one_record, small_config


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def records(target):
    return [one_record(target, 30), {"prompt_ids": [3, 4], "response_ids": list(range(10, 40))}]


def weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if t.is_floating_point()}


def test_the_average_follows_the_live_weights_step_by_step(target, tmp_path):
    decay = 0.75
    trainer = Trainer(small_config(tmp_path, epochs=3, ema_decay=decay), target, DFlashMethod(), records(target))
    trainer.train_step()
    first = weights(trainer.model)
    for name, value in weights(trainer.full_model()).items():  # the first update copies the weights
        torch.testing.assert_close(value, first[name], rtol=0, atol=0)
    trainer.train_step()
    second = weights(trainer.model)
    averaged = weights(trainer.full_model())
    moved = False
    for name, value in averaged.items():
        torch.testing.assert_close(value, decay * first[name] + (1 - decay) * second[name])
        moved |= not torch.equal(first[name], second[name])
    assert moved  # the live weights stepped, so the average differs from them
    assert not all(torch.equal(averaged[n], second[n]) for n in averaged)


def test_final_ships_the_average_and_it_drafts_losslessly(target, tmp_path):
    trainer = Trainer(small_config(tmp_path, epochs=4, ema_decay=0.9), target, DFlashMethod(), records(target))
    final = trainer.run()
    shipped = DFlashDraftModel.from_pretrained(final)
    for name, value in weights(shipped).items():
        torch.testing.assert_close(value, weights(trainer.ema.module)[name], rtol=0, atol=0)
    assert any(not torch.equal(value, weights(trainer.model)[name]) for name, value in weights(shipped).items())
    prompt = [5, 17, 33, 2, 9, 40]
    engine = SpecEngine(target, DFlashDrafter(shipped.eval(), target), 8)
    out = [t for chunk in engine.generate(prompt, max_new_tokens=24, stop_token_ids=(-1,)) for t in chunk]
    assert out == hf_greedy(target.model, prompt, 24, (-1,))


def test_resume_with_an_average_is_bit_identical(target, tmp_path):
    straight = Trainer(small_config(tmp_path / "a", epochs=6, ema_decay=0.8), target, DFlashMethod(),
                       records(target))
    straight.run()
    first = Trainer(small_config(tmp_path / "b", epochs=6, max_steps=5, save_every=5, ema_decay=0.8), target,
                    DFlashMethod(), records(target))
    first.run()
    resumed = Trainer(small_config(tmp_path / "b", epochs=6, ema_decay=0.8), target, DFlashMethod(),
                      records(target))
    resumed.run(resume=True)
    assert resumed.step == straight.step == 12
    for mine, theirs in ((straight.model, resumed.model), (straight.ema.module, resumed.ema.module)):
        for (name, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), name


def test_ema_decay_is_checked(target, tmp_path):
    for bad in (1.0, -0.1):
        with pytest.raises(InvalidArgumentError, match="ema_decay must be in"):
            Trainer(small_config(tmp_path, ema_decay=bad), target, DFlashMethod(), records(target))
    with pytest.raises(InvalidArgumentError, match="ema_decay is not sharded"):
        check_config(small_config(tmp_path, ema_decay=0.9, parallel="fsdp", batch_size=2), DFlashMethod(), 2)
    # a run folder resumes only with the averaging it was started with
    Trainer(small_config(tmp_path / "plain", max_steps=2, save_every=1), target, DFlashMethod(),
            records(target)).run()
    with pytest.raises(InvalidArgumentError, match="started without --ema-decay"):
        Trainer(small_config(tmp_path / "plain", ema_decay=0.9), target, DFlashMethod(), records(target)).run(
            resume=True)
    Trainer(small_config(tmp_path / "avg", max_steps=2, save_every=1, ema_decay=0.9), target, DFlashMethod(),
            records(target)).run()
    with pytest.raises(InvalidArgumentError, match="started with --ema-decay"):
        Trainer(small_config(tmp_path / "avg"), target, DFlashMethod(), records(target)).run(resume=True)


def test_average_drafters_script_writes_the_mean_and_refuses_other_models(target, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "average_drafters.py"
    finals = [Trainer(small_config(tmp_path / f"s{seed}", max_steps=2, seed=seed, draft_vocab_size=24), target,
                      DFlashMethod(), records(target)).run() for seed in (1, 2)]
    out = tmp_path / "mean"
    done = subprocess.run([sys.executable, str(script), str(out), *map(str, finals), "--weights", "1,3"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    parts = [weights(DFlashDraftModel.from_pretrained(f)) for f in finals]
    mean = DFlashDraftModel.from_pretrained(out)
    for name, value in weights(mean).items():
        torch.testing.assert_close(value, 0.25 * parts[0][name] + 0.75 * parts[1][name])
    assert torch.equal(mean.d2t, DFlashDraftModel.from_pretrained(finals[0]).d2t)
    other = Trainer(small_config(tmp_path / "wide", max_steps=1, num_layers=2, draft_vocab_size=24), target,
                    DFlashMethod(), records(target)).run()
    refused = subprocess.run([sys.executable, str(script), str(tmp_path / "no"), str(finals[0]), str(other)],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "not the same model" in refused.stderr and "num_hidden_layers" in refused.stderr
    assert not (tmp_path / "no").exists()
