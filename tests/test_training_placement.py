"""Training on any device (issue 13): placement, an eval that never mutates the training
model, 16-bit features that never overflow, time-budgeted runs, and the bad inputs of a
campaign (a missing device, data or a run folder of another target)."""

from __future__ import annotations

import ctypes
import json
import sys

import pytest
import torch

from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter, compact_features
from blockspec.targets.loading import check_device
from blockspec.training.methods.dflash import DFlashMethod
from blockspec.training.trainer import Trainer, release_freed_memory
from conftest import tiny_model, tiny_target
from test_training import one_record, small_config


def test_every_parameter_and_buffer_of_the_drafter_sits_on_the_targets_device(tmp_path):
    target = tiny_target("llama")
    trainer = Trainer(small_config(tmp_path, draft_vocab_size=48), target, DFlashMethod(), [one_record(target)])
    head = [t for t in trainer._head if t is not None]
    places = {t.device for t in [*trainer.model.parameters(), *trainer.model.buffers(), *head]}
    assert places == {target.device}


def test_a_held_out_eval_leaves_the_training_model_as_it_was(tmp_path):
    # A target in another dtype than the fp32 training weights (a bf16 GPU target in real
    # life; float64 here, which this CPU computes): the drafter the eval builds must not
    # convert the model under the optimizer in place, nor switch it to eval mode.
    model = tiny_model("llama").to(torch.float64)
    target = TargetAdapter(model, tokenizer=None, name="tiny-llama-f64")
    config = small_config(tmp_path, epochs=2, eval_every=1, eval_prompts=1, eval_max_new_tokens=8, holdout=1)
    records = [one_record(target, 24), one_record(target, 20)]
    trainer = Trainer(config, target, DFlashMethod(), records)
    before = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    trainer.model.train()
    tau = trainer.evaluate_tau()
    assert tau is not None and tau >= 1.0
    assert trainer.model.training
    for name, tensor in trainer.model.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    drafter = DFlashDrafter(trainer.model, target)
    assert drafter.model is not trainer.model and next(drafter.model.parameters()).dtype == torch.float64
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.run()  # trains with evals in between, in fp32 throughout
    assert next(trainer.model.parameters()).dtype == torch.float32


def test_features_are_stored_in_16_bits_without_ever_overflowing():
    small = torch.tensor([[1.5, -3.0], [70000.0 / 4, 2.0]])
    assert compact_features(small).dtype == torch.float16
    huge = torch.tensor([[1.5, -3.0], [7.0e5, 2.0]])  # a Gemma-like activation past fp16's 65504
    stored = compact_features(huge)
    assert stored.dtype == torch.bfloat16 and bool(torch.isfinite(stored).all())
    torch.testing.assert_close(stored.float(), huge, rtol=1e-2, atol=0)


def test_regenerated_features_switch_to_bf16_when_fp16_would_overflow():
    from blockspec.training.regenerate import generate_batch

    model = tiny_model("llama")
    with torch.no_grad():  # blow up one decoder layer's output scale
        model.model.layers[1].mlp.down_proj.weight.mul_(1e6)
    responses, features, _ = generate_batch(model, [[3, 4, 5]], 4, (-1,), feature_layers=[1, 2])
    assert features[0].dtype == torch.bfloat16 and bool(torch.isfinite(features[0]).all())


def test_a_device_that_is_asked_for_but_missing_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidArgumentError, match="no CUDA device"):
        check_device("cuda")
    with pytest.raises(InvalidArgumentError, match="unknown device"):
        check_device("gpu0")
    assert check_device("cpu").type == "cpu"


def test_the_cli_names_a_missing_device(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from blockspec.cli import main

    code = main(["train", "--data", str(tmp_path), "--device", "cuda", "--output", str(tmp_path / "run")])
    assert code == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_a_time_budget_stops_the_run_and_spans_the_schedule(tmp_path, clock):
    target = tiny_target("llama")
    # the budget is sized from this machine's own step time, so that a busy machine still fits several steps
    probe = Trainer(small_config(tmp_path / "probe", epochs=3, time_budget_clock=clock), target, DFlashMethod(),
                    [one_record(target)])
    probe.run()
    step_seconds = probe.train_seconds / probe.step
    budget = max(1.0, 8 * step_seconds)
    config = small_config(tmp_path, epochs=10_000, time_budget_s=budget, warmup_ratio=0.1, save_every=5,
                          time_budget_clock=clock)
    trainer = Trainer(config, target, DFlashMethod(), [one_record(target)])
    trainer.run()
    assert budget <= trainer.train_seconds < budget + 4 * step_seconds + 1.0 and 3 < trainer.step < 10_000
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [row["lr"] for row in history]
    assert max(rates) > rates[-1] and rates[-1] < 0.05 * config.lr  # cosine to ~0 at the budget's end
    resumed = Trainer(config, target, DFlashMethod(), [one_record(target)])
    resumed.run(resume=True)  # the budget is spent: nothing more to train
    assert resumed.step == trainer.step
    with pytest.raises(InvalidArgumentError, match="time_budget_s"):
        Trainer(small_config(tmp_path, time_budget_s=-1.0), target, DFlashMethod(), [one_record(target)])
    with pytest.raises(InvalidArgumentError, match="time_budget_clock"):
        Trainer(small_config(tmp_path, time_budget_s=1.0, time_budget_clock="gpu"), target, DFlashMethod(),
                [one_record(target)])


def test_data_or_a_run_folder_of_another_target_is_refused(tmp_path):
    from blockspec.training.data import DataConfig, build_dataset

    target = tiny_target("llama")
    other = tiny_target("llama", layers=3)
    data = tmp_path / "data"
    data.mkdir()  # as `blockspec data` writes it (a tiny target has no tokenizer to regenerate with)
    (data / "meta.json").write_text(json.dumps({"config": {}, "target": target.fingerprint()}))
    (data / "shard-00000.jsonl").write_text(json.dumps(one_record(target, 16)) + "\n")
    (data / "prompts.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(InvalidArgumentError, match="written by target"):
        Trainer(small_config(tmp_path, data=str(data)), other, DFlashMethod())
    with pytest.raises(InvalidArgumentError, match="written by target"):
        build_dataset(other, DataConfig(output=str(data), prompts=["unused"]))
    # a run folder trained for one target / shape cannot be resumed by another
    run = small_config(tmp_path, data=str(data), max_steps=2, save_every=1)
    Trainer(run, target, DFlashMethod()).run()
    with pytest.raises(InvalidArgumentError, match="cannot resume"):
        Trainer(small_config(tmp_path, data=str(data), num_layers=2), target, DFlashMethod()).run(resume=True)


def _resident_anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc's malloc_trim and /proc")
def test_the_heap_holes_a_step_leaves_go_back_to_the_os():
    # 64 KiB blocks come from glibc's heap (under its mmap threshold); one kept block above
    # them stops free() from shrinking the heap, as live tensors do between training steps
    blocks = [bytearray(64 * 1024) for _ in range(2048)]  # 128 MiB, pages touched (zeroed)
    kept = bytearray(64 * 1024)
    freed_at = _resident_anonymous_bytes()
    del blocks
    held = _resident_anonymous_bytes()
    assert held > freed_at - 32 * 2**20  # free() alone kept the holes
    assert release_freed_memory()
    assert _resident_anonymous_bytes() < held - 96 * 2**20
    del kept
