"""The adapter: the layer-id convention and cache rollback (including past a sliding window)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import DynamicCache

from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter, crop_cache_to_length
from blockspec.targets.layout import store_linear_weights_transposed
from conftest import ARCHITECTURES, tiny_config, tiny_model, tiny_target


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_id_is_output_of_decoder_layer(arch):
    """Layer id i = OUTPUT of decoder layer i (= hidden_states[i + 1]), pinned by a hook."""
    target = tiny_target(arch)
    captured = {}
    layers = target.model.model.layers
    hooks = [layer.register_forward_hook(lambda m, args, out, i=i: captured.__setitem__(i, out))
             for i, layer in enumerate(layers)]
    ids = torch.tensor([3, 9, 27, 4, 15])
    target.reset()
    layer_ids = (0, 1, 2)  # the last layer's entry is post-final-norm in transformers: not used by drafters
    out = target.forward(ids, layer_ids)
    for hook in hooks:
        hook.remove()
    hidden = target.hidden_size
    for slot, layer_id in enumerate(layer_ids):
        layer_out = captured[layer_id]
        layer_out = layer_out[0] if isinstance(layer_out, tuple) else layer_out
        torch.testing.assert_close(out.features[:, slot * hidden:(slot + 1) * hidden], layer_out[0], rtol=0, atol=0)


def test_crop_zero_tokens_is_a_noop():
    target = tiny_target("llama")
    target.reset()
    target.forward(torch.arange(2, 12))
    keys = [layer.keys.clone() for layer in target.cache.layers]
    crop_cache_to_length(target.cache, 10)
    assert target.seq_len == 10
    for before, layer in zip(keys, target.cache.layers):
        assert torch.equal(before, layer.keys)
    crop_cache_to_length(target.cache, 7)
    assert target.seq_len == 7
    with pytest.raises(ValueError):
        crop_cache_to_length(target.cache, 8)


def test_crop_on_an_empty_cache():
    cache = DynamicCache()
    crop_cache_to_length(cache, 0)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rollback_then_continue_matches_one_pass(arch):
    """Prefill 14, verify blocks that are partly rejected, continue to 30: the logits
    equal a single full forward. Gemma 3's window is 8: rollbacks happen far past it."""
    target = tiny_target(arch)
    sequence = torch.tensor([(i * 13 + 5) % 90 + 2 for i in range(30)])
    with torch.inference_mode():
        full = target.model(sequence[None]).logits[0]
    target.reset()
    target.forward(sequence[:14])
    target.rollback(14)
    outputs = []
    for start, accepted in [(14, 3), (17, 1), (18, 5), (23, 7)]:
        block = torch.cat([sequence[start:start + accepted], torch.tensor([50, 51, 52])])  # 3 rejected drafts
        outputs.append(target.forward(block).logits[:accepted])
        target.rollback(start + accepted)
    torch.testing.assert_close(torch.cat(outputs), full[14:30], rtol=1e-4, atol=1e-4)
    target.forward(torch.tensor([60, 61]))  # a fully rejected block
    target.rollback(30)
    target.rollback(30)  # zero tokens removed: a no-op
    assert target.seq_len == 30
    last = target.forward(torch.tensor([70])).logits
    with torch.inference_mode():
        expected = target.model(torch.cat([sequence, torch.tensor([70])])[None]).logits[0, -1:]
    torch.testing.assert_close(last, expected, rtol=1e-4, atol=1e-4)
    target.rollback(31)
    if arch == "gemma3":
        with pytest.raises(ValueError, match="sliding-window"):
            target.rollback(25)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sdpa_own_gqa_gives_the_repeated_heads_numbers(arch, monkeypatch):
    """load_target turns on SDPA's grouped-query attention on CPU (no copy of every K/V head):
    a tree verify pass (a mask, sliding windows included) gives the same logits either way."""
    from blockspec.targets.kv import SlotKV
    from blockspec.targets.loading import CPU_SDPA_GQA

    target = tiny_target(arch)
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(CPU_SDPA_GQA, setting)
        kv = SlotKV(target)
        kv.prefill(torch.arange(2, 30))
        logits[setting], _ = kv.verify([[5, 6, 7, 8, 9]], [[-1, 0, 0, 2]])
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transposed_weight_storage_keeps_the_numbers(arch):
    """load_target stores each Linear weight as the transpose of a contiguous [in, out]
    matrix (faster few-row products on CPU BLAS): the same Parameters with the same values, a
    tied head still tied, and a tree verify pass (mask, sliding windows) with the same logits
    up to float rounding."""
    from blockspec.targets.kv import SlotKV

    logits, layouts = {}, {}
    for transposed in (False, True):
        torch.manual_seed(0)
        config = tiny_config(arch)
        config.tie_word_embeddings = True
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        target = TargetAdapter(model, tokenizer=None, name=arch)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        parameters = dict(model.named_parameters())
        moved = store_linear_weights_transposed(model) if transposed else 0
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        layouts[transposed] = (moved, [m.weight.is_contiguous() for m in linears])
        assert dict(model.named_parameters()).keys() == parameters.keys()
        for name, p in model.named_parameters():
            assert p is parameters[name] and torch.equal(p, before[name]), name
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
        kv = SlotKV(target)
        kv.prefill(torch.arange(2, 30))
        logits[transposed], _ = kv.verify([[5, 6, 7, 8, 9]], [[-1, 0, 0, 2]])
    moved, contiguous = layouts[True]
    assert moved == len(contiguous) > 0 and not any(contiguous)  # every Linear of the body (the head is SkinnyHead)
    assert all(layouts[False][1])
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


def test_transposed_storage_leaves_other_weights_alone():
    """Only float32 CPU Linear weights move: a bf16 model keeps its layout, and a second call
    moves nothing."""
    model = tiny_model("llama").to(torch.bfloat16)
    assert store_linear_weights_transposed(model) == 0
    model = tiny_model("llama")
    assert store_linear_weights_transposed(model) > 0
    assert store_linear_weights_transposed(model) == 0


def test_linear_layout_named_in_the_environment_is_applied_without_measuring(monkeypatch, tmp_path):
    from blockspec.targets import layout

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(layout, "probe_linear_layout", lambda *a, **k: pytest.fail("measured"))
    for name, contiguous in (("transposed", False), ("row-major", True)):
        monkeypatch.setenv(layout.LAYOUT_ENV, name)
        model = tiny_model("llama")
        assert layout.lay_out_linear_weights(model) == {"layout": name, "source": "env"}
        assert all(m.weight.is_contiguous() == contiguous for m in model.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setenv(layout.LAYOUT_ENV, "columns")
    with pytest.raises(InvalidArgumentError, match="BLOCKSPEC_LINEAR_LAYOUT='columns'.*auto, row-major, transposed"):
        layout.choose_linear_layout(tiny_model("llama"))


@pytest.mark.parametrize("ratio, expected", [([0.85, 0.9], "transposed"), ([0.8, 0.95], "row-major"),
                                             ([1.1, 1.0], "row-major")])
def test_auto_linear_layout_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path, ratio, expected):
    """`auto` lays the weights out transposed only when this machine measured it clearly
    faster at every probed size; the answer is kept (atomically, in the cache dir) so later loads agree without a
    probe; another thread count is another question; a corrupt cache file is measured again."""
    from blockspec.targets import layout

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(layout.LAYOUT_ENV, raising=False)
    probes = []
    monkeypatch.setattr(layout, "probe_linear_layout", lambda shapes: probes.append(shapes) or ratio)
    model = tiny_model("llama")
    first = layout.lay_out_linear_weights(model)
    assert first == {"layout": expected, "ratio": ratio, "source": "measured"}
    assert probes == [layout.linear_shapes(tiny_model("llama"))]
    assert all(m.weight.is_contiguous() == (expected == "row-major")
               for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert layout.choose_linear_layout(tiny_model("llama")) == {"layout": expected, "ratio": ratio, "source": "cached"}
    assert len(probes) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert layout.choose_linear_layout(tiny_model("llama"))["source"] == "measured"
    finally:
        torch.set_num_threads(threads)
    assert len(probes) == 2 and len(json.loads((tmp_path / "linear-layout.json").read_text())) == 2
    (tmp_path / "linear-layout.json").write_text("{not json")
    assert layout.choose_linear_layout(tiny_model("llama"))["source"] == "measured"


def test_linear_layout_leaves_models_it_cannot_speed_up_alone(monkeypatch):
    """A bf16 model has no float32 CPU Linear to move: nothing is measured or changed."""
    from blockspec.targets import layout

    monkeypatch.delenv(layout.LAYOUT_ENV, raising=False)
    monkeypatch.setattr(layout, "probe_linear_layout", lambda *a, **k: pytest.fail("measured"))
    model = tiny_model("llama").to(torch.bfloat16)
    assert layout.lay_out_linear_weights(model) == {"layout": "row-major", "source": "not-applicable"}
    assert all(p.is_contiguous() for p in model.parameters())


def test_linear_layout_probe_times_both_layouts():
    """The real probe (tiny shapes, a MB): a positive, finite time ratio per row count."""
    from blockspec.targets.layout import probe_linear_layout

    ratios = probe_linear_layout([(96, 64), (64, 96)], rows=(1, 3), probe_bytes=1 << 20, repeats=3)
    assert len(ratios) == 2 and all(0 < ratio < float("inf") for ratio in ratios)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_drafter_precision_follows_the_cpu(native_bf16, monkeypatch):
    """`auto`: bf16 beside a float32 CPU target only where the CPU multiplies bf16 natively;
    otherwise, and for targets in other precisions, the target's; an explicit dtype wins."""
    from blockspec.errors import InvalidArgumentError
    from blockspec.targets import loading

    monkeypatch.setattr(loading, "cpu_has_bf16_matmul", lambda: native_bf16)
    target = tiny_target("llama")
    assert loading.drafter_dtype("auto", target) == (torch.bfloat16 if native_bf16 else torch.float32)
    assert loading.drafter_dtype("float32", target) == torch.float32
    assert loading.drafter_dtype("bfloat16", target) == torch.bfloat16
    target.dtype = torch.float16  # as a target loaded in fp16 says
    assert loading.drafter_dtype("auto", target) == torch.float16
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        loading.drafter_dtype("int8", target)


@pytest.mark.parametrize("amx, avx512_bf16", [(True, True), (False, True), (False, False)])
def test_bf16_matmul_needs_amx(amx, avx512_bf16, monkeypatch):
    """Only AMX tiles make bf16 products faster than fp32 ones on a CPU: with AVX512-BF16
    alone (session 14's VM) they measured 1.2-1.9x slower, so `auto` must stay float32 there."""
    from blockspec.targets import loading

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert loading.cpu_has_bf16_matmul() is amx
