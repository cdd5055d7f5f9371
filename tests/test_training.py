"""The DFlash training recipe: block-sparse batches, the overfit gate, exact resume, typed config."""

from __future__ import annotations

import pytest
import torch

from blockspec.decoding.engine import SpecEngine
from blockspec.decoding.stats import GenerationStats
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import InvalidArgumentError
from blockspec.training.config import TrainConfig, load_config
from blockspec.training.methods import METHODS
from blockspec.training.methods.dflash import DFlashMethod, build_blocks
from blockspec.training import trainer as trainer_module
from blockspec.training.trainer import IGNORE, Trainer, autocast_dtype, loss_weights, sample_anchors
from conftest import DATA_DIR, hf_greedy, tiny_target


def test_blocks_see_context_strictly_before_their_anchor_and_only_their_own_block():
    sequence = torch.arange(100, 120)
    anchors = torch.tensor([5, 12])
    block_ids, positions, labels, mask = build_blocks([sequence], [anchors], 4, 99, context_len=20)
    assert block_ids[0].tolist() == [105, 99, 99, 99, 112, 99, 99, 99]
    assert positions[0].tolist() == [5, 6, 7, 8, 12, 13, 14, 15]
    assert labels[0].tolist() == [IGNORE, 106, 107, 108, IGNORE, 113, 114, 115]
    context, blocks = mask[0, 0, :, :20], mask[0, 0, :, 20:]
    assert context[:4].sum(1).tolist() == [5] * 4 and context[:4, :5].all()
    assert context[4:].sum(1).tolist() == [12] * 4 and context[4:, :12].all()
    assert blocks[:4, :4].all() and blocks[4:, 4:].all() and not blocks[:4, 4:].any() and not blocks[4:, :4].any()
    # labels past the end of the sequence are ignored
    _, _, labels, _ = build_blocks([sequence], [torch.tensor([18])], 4, 99, context_len=20)
    assert labels[0].tolist() == [IGNORE, 119, IGNORE, IGNORE]


def test_anchors_are_response_tokens_with_a_label_and_reproducible():
    draws = [sample_anchors(10, 30, 8, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert draws[0].numel() == 8 and draws[0].min() >= 10 and draws[0].max() <= 28
    assert len(set(draws[0].tolist())) == 8
    assert sample_anchors(10, 11, 8, torch.Generator()).numel() == 0


def test_loss_weights_decay_from_the_first_draft():
    weights = loss_weights(16, 7.0)
    assert weights[0] == 0 and weights[1] == 1.0
    torch.testing.assert_close(weights[8], torch.tensor(float(torch.exp(torch.tensor(-1.0)))))


def one_record(target, length=48):
    prompt = [5, 17, 33, 2, 9, 40]
    return {"prompt_ids": prompt, "response_ids": hf_greedy(target.model, prompt, length, (-1,))}


def small_config(tmp_path, **overrides):
    # fp32 unless a test asks: "auto" would pick bf16 on CPUs with bf16 units and fp32 elsewhere
    values = dict(data="unused", output=str(tmp_path / "run"), num_layers=1, block_size=8, num_anchors=16,
                  batch_size=1, lr=3e-3, epochs=1, holdout=0, eval_every=0, save_every=1000, warmup_ratio=0.0,
                  precision="fp32")
    values.update(overrides)
    return TrainConfig(**values)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overfit_gate_a_drafter_trained_on_one_sequence_drafts_it_whole(tmp_path, precision):
    """bf16: the step autocasts (master weights and loss fp32), and the drafter still learns
    the sequence whole."""
    target = tiny_target("llama")
    record = one_record(target)
    config = small_config(tmp_path, epochs=300, precision=precision)
    trainer = Trainer(config, target, DFlashMethod(), records=[record])
    trainer.run()
    drafter = DFlashDrafter(trainer.model.eval(), target)
    stats = GenerationStats(8)
    out = [t for c in SpecEngine(target, drafter, 8).generate(record["prompt_ids"], max_new_tokens=40,
                                                               stop_token_ids=(-1,), stats=stats) for t in c]
    assert out == record["response_ids"][:40]
    assert stats.tau >= 7.0, stats.accept_hist


@pytest.mark.parametrize("method", list(METHODS))
def test_resume_is_bit_identical(tmp_path, method):
    target = tiny_target("llama")
    records = [one_record(target, 30), {"prompt_ids": [3, 4], "response_ids": list(range(10, 40))}]
    shape = dict(method=method, num_layers=2 if method == "draft-model" else 1)
    straight = Trainer(small_config(tmp_path / "a", epochs=6, batch_size=1, holdout=0, **shape), target,
                       METHODS[method], records)
    straight.run()
    first = Trainer(small_config(tmp_path / "b", epochs=6, max_steps=5, save_every=5, **shape), target,
                    METHODS[method], records)
    first.run()
    resumed = Trainer(small_config(tmp_path / "b", epochs=6, **shape), target, METHODS[method], records)
    resumed.run(resume=True)
    assert resumed.step == straight.step == 12
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert (tmp_path / "b" / "run" / "final" / "model.safetensors").exists()
    assert (tmp_path / "b" / "run" / "metrics.png").exists()


def test_config_rejects_unknown_keys(tmp_path):
    assert load_config(TrainConfig, None, ["--block-size", "8", "--target-layer-ids", "1,2"]).target_layer_ids == [1, 2]
    with pytest.raises(InvalidArgumentError, match="unknown option --blok-size"):
        load_config(TrainConfig, None, ["--blok-size", "8"])
    bad = tmp_path / "c.json"
    bad.write_text('{"lr": 0.1, "learning_rate": 2}')
    with pytest.raises(InvalidArgumentError, match="learning_rate"):
        load_config(TrainConfig, str(bad), [])


def test_bad_dataset_files_are_clear_errors(tmp_path):
    from blockspec.training.data import load_records, read_prompts

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl:2: not valid JSON"):
        read_prompts(str(bad))
    bad.write_text('{"title": "no prompt field"}\n')
    with pytest.raises(InvalidArgumentError, match="none of the fields"):
        read_prompts(str(bad))
    with pytest.raises(InvalidArgumentError, match="no shard"):
        load_records(tmp_path)
    (tmp_path / "shard-00000.jsonl").write_text('{"prompt_ids": [1]}\n')
    with pytest.raises(InvalidArgumentError, match="lacks"):
        load_records(tmp_path)


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="public data not present")
def test_prompts_from_the_shared_gsm8k_train_file():
    from blockspec.training.data import read_prompts

    prompts = read_prompts(str(DATA_DIR / "gsm8k" / "train.jsonl"), limit=3)
    assert len(prompts) == 3 and prompts[0].startswith("Natalia sold clips")


def test_random_mask_reveals_some_tokens_and_only_unlabels_them():
    from blockspec.training.methods.dflash import partially_unmask

    sequence = torch.arange(10, 60)
    anchors = [torch.tensor([3, 20, 35])]
    block_ids, _, labels, _ = build_blocks([sequence], anchors, 8, 99, 50)
    revealed_ids, revealed_labels = partially_unmask(block_ids, labels, 8, [torch.Generator().manual_seed(0)])
    revealed = revealed_ids != block_ids
    assert revealed.any()
    # a revealed position holds its true token and has no label; every other label is untouched
    assert torch.equal(revealed_ids[revealed], labels[revealed])
    assert bool((revealed_labels[revealed] == IGNORE).all())
    assert torch.equal(revealed_labels[~revealed], labels[~revealed])
    # anchors are never touched and every block keeps at least one masked, labelled position
    assert torch.equal(revealed_ids[0, ::8], block_ids[0, ::8])
    for block in range(3):
        assert (revealed_labels[0, block * 8 + 1:(block + 1) * 8] != IGNORE).any()


def test_mtp_overfit_gate_and_checkpoint_round_trip(tmp_path):
    from blockspec.drafters.mtp import MTPDrafter, MTPHeadModel
    from blockspec.training.methods.mtp import MTPMethod

    target = tiny_target("llama")
    record = one_record(target)
    trainer = Trainer(small_config(tmp_path, epochs=300, method="mtp", lr=3e-3), target, MTPMethod(),
                      records=[record])
    trainer.run()
    loaded = MTPHeadModel.from_pretrained(tmp_path / "run" / "final")
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    drafter = MTPDrafter(loaded, target)
    stats = GenerationStats(8)
    out = [t for c in SpecEngine(target, drafter, 8).generate(record["prompt_ids"], max_new_tokens=40,
                                                               stop_token_ids=(-1,), stats=stats) for t in c]
    assert out == record["response_ids"][:40]
    assert stats.tau >= 6.0, stats.accept_hist


def test_draft_model_overfit_gate_and_loading_as_model_folder(tmp_path):
    from blockspec.training.methods.draft_model import DraftLM, DraftModelMethod

    target = tiny_target("llama")
    record = one_record(target)
    trainer = Trainer(small_config(tmp_path, epochs=150, method="draft-model", num_layers=2, lr=3e-3),
                      target, DraftModelMethod(), records=[record])
    trainer.run()
    drafter = trainer.method.make_drafter(trainer.model, target)
    stats = GenerationStats(8)
    out = [t for c in SpecEngine(target, drafter, 8).generate(record["prompt_ids"], max_new_tokens=40,
                                                               stop_token_ids=(-1,), stats=stats) for t in c]
    assert out == record["response_ids"][:40]
    assert stats.tau >= 6.0, stats.accept_hist
    # the saved folder is an ordinary transformers model: `model:FOLDER` loads it as a drafter
    reloaded = DraftLM.from_pretrained(tmp_path / "run" / "final")
    for (name, a), (_, b) in zip(trainer.model.lm.state_dict().items(), reloaded.lm.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(InvalidArgumentError, match="draft_vocab_size"):
        Trainer(small_config(tmp_path / "x", method="draft-model", draft_vocab_size=10), target, DraftModelMethod(),
                [record])


def test_eagle3_overfit_gate_and_checkpoint_round_trip(tmp_path):
    from blockspec.drafters.eagle3 import Eagle3Drafter, Eagle3DraftModel
    from blockspec.drafters.registry import load_drafter
    from blockspec.training.methods.eagle3 import Eagle3Method

    target = tiny_target("llama")
    record = one_record(target)
    trainer = Trainer(small_config(tmp_path, epochs=300, method="eagle3", lr=3e-3, draft_vocab_size=60),
                      target, Eagle3Method(), records=[record])
    trainer.run()
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "run" / "final")
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert isinstance(load_drafter(str(tmp_path / "run" / "final"), target), Eagle3Drafter)  # by architecture
    drafter = Eagle3Drafter(loaded, target)
    stats = GenerationStats(8)
    out = [t for c in SpecEngine(target, drafter, 8).generate(record["prompt_ids"], max_new_tokens=40,
                                                               stop_token_ids=(-1,), stats=stats) for t in c]
    assert out == record["response_ids"][:40]
    assert stats.tau >= 6.0, stats.accept_hist


def test_eagle3_training_unroll_is_what_drafting_computes(tmp_path):
    """For one chain, the training unroll's logits at every step equal the drafter's when it
    is fed the same (true) tokens: training and drafting see the same attention."""
    import torch.nn.functional as F

    from blockspec.drafters.eagle3 import Eagle3Drafter
    from blockspec.training.methods.eagle3 import Eagle3Method

    target = tiny_target("llama")
    record = one_record(target, 24)
    trainer = Trainer(small_config(tmp_path, method="eagle3", block_size=6, num_anchors=1), target, Eagle3Method(),
                      [record])
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    captured = []
    original = F.linear

    def spy(x, weight, bias=None):
        out = original(x, weight, bias)
        if weight is trainer._head[0]:
            captured.append(out.detach()[0])
        return out

    F.linear = spy
    try:
        trainer.method.loss(trainer, [0], epoch=0)
    finally:
        F.linear = original
    sequence, prompt_len = trainer.sequence(0)
    generator = torch.Generator().manual_seed(trainer.config.seed * 1_000_003)
    anchor = int(sample_anchors(prompt_len, sequence.numel(), 1, generator)[0])
    drafter = Eagle3Drafter(trainer.model.eval(), target)
    drafter.begin(sequence[:anchor], trainer.features([0])[0][:anchor].float())
    drafted = []

    def true_tokens(step, logits):
        drafted.append(logits[0])
        return sequence[anchor + 1 + step]

    steps = min(5, sequence.numel() - anchor - 1)
    drafter.unroll(sequence[:anchor + 1], steps, true_tokens)
    assert len(captured) == steps
    for step, (train, draft) in enumerate(zip(captured, drafted)):
        torch.testing.assert_close(train, draft, rtol=1e-4, atol=1e-4, msg=f"step {step + 1}")


def test_distillation_from_the_targets_top1_is_the_hard_label_loss(tmp_path):
    """On the target's own greedy text, its top-1 distribution IS the label: the soft-label
    loss with k = 1 equals the hard-label loss; with k = 5 it spreads over other tokens."""
    target = tiny_target("llama")
    records = [one_record(target, 30), one_record(target, 20)]
    losses = {}
    for k in (0, 1, 5):
        trainer = Trainer(small_config(tmp_path / str(k), batch_size=2, distill_topk=k), target, DFlashMethod(),
                          records)
        losses[k] = float(trainer.method.loss(trainer, [0, 1], epoch=0)[0].detach())
        if k == 5:
            indices = [0, 1]
            sequences = [trainer.sequence(i)[0] for i in indices]
            positions = torch.stack([torch.arange(6, 26)] * 2)  # response tokens (the prompt is 6 long)
            labels = torch.stack([s[6:26] for s in sequences])
            ids, probs = trainer.soft_labels(indices, positions, labels)
            torch.testing.assert_close(probs.sum(-1), torch.ones(2, 20))
            # the heaviest soft label is the token itself (greedy text)
            assert torch.equal(ids.gather(2, probs.argmax(-1, keepdim=True))[..., 0], labels)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[5] != pytest.approx(losses[0], rel=1e-3)
    # records with no stored distribution keep their hard labels when told to: no target pass for them
    keep_hard = Trainer(small_config(tmp_path / "hard", batch_size=2, distill_topk=5, distill_missing="hard"),
                        target, DFlashMethod(), records)
    assert float(keep_hard.method.loss(keep_hard, [0, 1], epoch=0)[0].detach()) == pytest.approx(losses[0], rel=1e-5)
    assert keep_hard._top == {}
    with pytest.raises(InvalidArgumentError, match="distill_topk"):
        Trainer(small_config(tmp_path / "bad", distill_topk=-1), target, DFlashMethod(), records)
    with pytest.raises(InvalidArgumentError, match="distill_missing must be compute or hard"):
        Trainer(small_config(tmp_path / "bad2", distill_topk=4, distill_missing="skip"), target, DFlashMethod(), records)


def test_expected_length_weights_follow_the_drafters_own_accuracy(tmp_path):
    target = tiny_target("llama")
    trainer = Trainer(small_config(tmp_path, loss_weighting="expected-length", epochs=3), target, DFlashMethod(),
                      [one_record(target)])
    trainer.position_accuracy = torch.tensor([0.0, 0.9, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])
    weights = trainer.position_weights()
    torch.testing.assert_close(weights[:5], torch.tensor([0.0, 1.0, 0.9, 0.45, 0.225]))
    trainer.run()  # the running accuracy moves with training and the loss stays finite
    assert not torch.equal(trainer.position_accuracy[1:], torch.tensor([0.9, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]))
    assert float(trainer.position_weights()[1]) == 1.0
    with pytest.raises(InvalidArgumentError, match="loss_weighting"):
        Trainer(small_config(tmp_path, loss_weighting="dpace"), target, DFlashMethod(), [one_record(target)])


def test_the_draft_vocabulary_takes_the_frequent_tokens_then_the_lowest_unseen_ids():
    from blockspec.training.trainer import draft_vocabulary

    records = [{"prompt_ids": [1], "response_ids": [90, 90, 90, 40, 40, 7]}]
    assert draft_vocabulary(records, 3, 96).tolist() == [7, 40, 90]
    assert draft_vocabulary(records, 2, 96).tolist() == [40, 90]
    # fewer distinct tokens than slots: the rest are the lowest unseen ids, not arbitrary ones
    assert draft_vocabulary(records, 6, 96).tolist() == [0, 1, 2, 7, 40, 90]
    # a warm start's vocabulary fills the free slots before the unseen ids, never displaces a seen token
    preferred = torch.tensor([50, 7, 60, 61])
    assert draft_vocabulary(records, 5, 96, preferred).tolist() == [7, 40, 50, 60, 90]
    assert draft_vocabulary(records, 3, 96, preferred).tolist() == [7, 40, 90]


def test_a_warm_start_keeps_its_weights_and_fills_the_free_vocabulary_slots_with_its_own(tmp_path):
    """--init-from: the drafter starts from the folder's weights; the draft vocabulary is built
    from this run's data, and the slots that data leaves free go to the warm start's tokens."""
    target = tiny_target("llama")
    first = Trainer(small_config(tmp_path / "a", draft_vocab_size=24, epochs=2), target, DFlashMethod(),
                    [one_record(target)])
    first.run()
    record = {"prompt_ids": [3, 4], "response_ids": [11, 12, 11, 13] * 5}  # 3 distinct tokens for 24 slots
    second = Trainer(small_config(tmp_path / "b", draft_vocab_size=24, init_from=str(tmp_path / "a" / "run" / "final")),
                     target, DFlashMethod(), [record])
    torch.testing.assert_close(second.model.fc.weight, first.model.fc.weight)
    vocabulary = set(second.model.d2t.tolist())
    assert {11, 12, 13} <= vocabulary
    assert vocabulary - {11, 12, 13} <= set(first.model.d2t.tolist())


def test_keep_init_vocabulary_drafts_the_warm_starts_tokens_whatever_this_data_holds(tmp_path):
    """--keep-init-vocabulary: the warm start's draft vocabulary stays as it was (not rebuilt
    from this run's data), and the stored head is that vocabulary's rows of the target's head;
    without a warm start, or at another size, it is a clear error."""
    target = tiny_target("llama")
    first = Trainer(small_config(tmp_path / "a", draft_vocab_size=24, epochs=2), target, DFlashMethod(),
                    [one_record(target)])
    first.run()
    warm = str(tmp_path / "a" / "run" / "final")
    record = {"prompt_ids": [3, 4], "response_ids": [11, 12, 11, 13] * 5}
    kept = Trainer(small_config(tmp_path / "b", draft_vocab_size=24, init_from=warm, keep_init_vocabulary=True),
                   target, DFlashMethod(), [record])
    assert kept.model.d2t.tolist() == first.model.d2t.tolist()
    rebuilt = Trainer(small_config(tmp_path / "c", draft_vocab_size=24, init_from=warm), target, DFlashMethod(),
                      [record])
    assert rebuilt.model.d2t.tolist() != first.model.d2t.tolist()  # the data's 3 tokens come first
    torch.testing.assert_close(kept.model.stored_head, target.lm_head.weight[first.model.d2t])
    assert kept.t2d[first.model.d2t].tolist() == list(range(24))
    with pytest.raises(InvalidArgumentError, match="drafts 24 tokens, this run --draft-vocab-size 16"):
        Trainer(small_config(tmp_path / "d", draft_vocab_size=16, init_from=warm, keep_init_vocabulary=True),
                target, DFlashMethod(), [record])
    with pytest.raises(InvalidArgumentError, match="keep_init_vocabulary needs --init-from"):
        Trainer(small_config(tmp_path / "e", draft_vocab_size=24, keep_init_vocabulary=True), target,
                DFlashMethod(), [record])


def test_a_warm_start_grows_a_deeper_drafter_that_drafts_exactly_as_the_shallower_one(tmp_path):
    """--init-from a 1-layer drafter into a 2-layer run: layer 0 is the folder's, the added layer
    starts as the identity, so the drafter's hidden states are unchanged until training moves
    them; a run with FEWER layers than the folder's is an error."""
    target = tiny_target("llama")
    record = one_record(target)
    first = Trainer(small_config(tmp_path / "a", epochs=2), target, DFlashMethod(), [record])
    first.run()
    layer_ids = first.model.config.target_layer_ids
    grown = Trainer(small_config(tmp_path / "b", num_layers=2, target_layer_ids=layer_ids, epochs=1,
                                 init_from=str(tmp_path / "a" / "run" / "final")), target, DFlashMethod(), [record])
    assert len(grown.model.layers) == 2
    torch.testing.assert_close(grown.model.layers[0].mlp.up_proj.weight, first.model.layers[0].mlp.up_proj.weight)
    assert grown.model.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # trainable, not dead
    hidden = first.model.config.hidden_size
    features = torch.randn(1, 12, len(layer_ids) * hidden)
    block = torch.randn(1, 8, hidden)
    with torch.no_grad():
        states = [model(block, torch.arange(12, 20)[None], model.context_key_values(features, torch.arange(12)[None]))
                  for model in (first.model, grown.model)]
    torch.testing.assert_close(states[0], states[1])
    grown.run()  # training moves the added layer
    assert grown.model.layers[1].self_attn.o_proj.weight.abs().sum() > 0
    with pytest.raises(InvalidArgumentError, match="num_hidden_layers is 2, this run trains 1"):
        Trainer(small_config(tmp_path / "c", target_layer_ids=layer_ids, init_from=str(tmp_path / "b" / "run" / "final")),
                target, DFlashMethod(), [record])


def test_distilling_runs_one_target_pass_per_new_batch_for_features_and_distributions(tmp_path):
    target = tiny_target("llama")
    records = [one_record(target, 20), {"prompt_ids": [3, 4], "response_ids": list(range(10, 30))}]
    trainer = Trainer(small_config(tmp_path, distill_topk=4, batch_size=2, epochs=2), target, DFlashMethod(),
                      records)
    calls = []
    forward = target.model.forward
    target.model.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        trainer.run()
    finally:
        target.model.forward = forward
    assert trainer.step == 2 and len(trainer._top) == 2 and len(trainer._features) == 2
    assert len(calls) == 1  # one pass filled both caches; the second epoch reused them


def test_precision_auto_takes_bf16_where_the_cpu_multiplies_it_natively(tmp_path, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype("fp32", cuda) is None and autocast_dtype("bf16", cpu) is torch.bfloat16
    assert autocast_dtype("auto", cuda) is torch.bfloat16
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(trainer_module, "cpu_trains_faster_in_bf16", lambda native=native: native)
        assert autocast_dtype("auto", cpu) is expected
    target = tiny_target("llama")
    trainer = Trainer(small_config(tmp_path, precision="bf16"), target, DFlashMethod(), [one_record(target)])
    assert trainer.train_step()["loss"] > 0
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    with pytest.raises(InvalidArgumentError, match="precision must be auto, bf16 or fp32"):
        Trainer(small_config(tmp_path, precision="fp16"), target, DFlashMethod(), [one_record(target)])
