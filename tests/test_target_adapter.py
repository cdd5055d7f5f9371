"""The adapter: the layer-id convention and cache rollback (including past a sliding window)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import DynamicCache

from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import TargetAdapter, crop_cache_to_length
from blockspec.targets.linear_kernels import (KERNELS, PROBE_ROWS, RowDispatchLinear, kernel_table, onednn_available,
                                             probe_linear_kernels, use_linear_kernels)
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


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_linear_kernel_keeps_the_numbers_and_the_parameters(arch, kernel):
    """Each kernel `load_target` may pick computes the Linear products of a tree verify pass
    (mask, sliding windows) with transformers' own logits up to float rounding, on the same
    Parameters (a tied head still tied), and hands anything needing gradients to F.linear."""
    from blockspec.targets.kv import SlotKV

    if kernel == "onednn" and not onednn_available():
        pytest.skip("this torch build has no oneDNN linear kernels")
    logits = {}
    for dispatched in (False, True):
        torch.manual_seed(0)
        config = tiny_config(arch)
        config.tie_word_embeddings = True
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        target = TargetAdapter(model, tokenizer=None, name=arch)
        parameters = dict(model.named_parameters())
        replaced = use_linear_kernels(model, {rows: kernel for rows in PROBE_ROWS}) if dispatched else 0
        assert replaced == (sum(isinstance(m, torch.nn.Linear) for m in tiny_model(arch).modules()) if dispatched else 0)
        assert dict(model.named_parameters()) == parameters  # the same Parameter objects
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
        kv = SlotKV(target)
        kv.prefill(torch.arange(2, 30))
        logits[dispatched], _ = kv.verify([[5, 6, 7, 8, 9]], [[-1, 0, 0, 2]])
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    head = model.get_output_embeddings()
    hidden = torch.randn(3, config.hidden_size, requires_grad=True)
    head(hidden).sum().backward()  # F.linear under autograd: a gradient, and the same one
    torch.testing.assert_close(hidden.grad, head.weight.sum(0).expand(3, -1).detach())


def test_each_pass_width_takes_the_kernel_of_the_smallest_probed_width_at_least_as_wide(monkeypatch):
    from blockspec.targets import linear_kernels

    table = kernel_table({1: "weight-first", 4: "onednn", 16: "linear"})
    assert table[1:] == ["weight-first"] + ["onednn"] * 3 + ["linear"] * 12
    layer = RowDispatchLinear(torch.nn.Linear(8, 5), table) if onednn_available() else None
    if layer is None:
        pytest.skip("this torch build has no oneDNN linear kernels")
    used = []
    monkeypatch.setattr(linear_kernels, "_onednn", lambda flat, packed, bias: used.append(flat.shape[0]) or
                        torch.nn.functional.linear(flat, layer.weight, bias))
    with torch.inference_mode():
        for rows in (1, 3, 4, 9, 40):
            expected = torch.nn.functional.linear(torch.ones(1, rows, 8), layer.weight, layer.bias)
            torch.testing.assert_close(layer(torch.ones(1, rows, 8)), expected)
    assert used == [3, 4]  # 40 rows: beyond the table, its widest entry (linear)


@pytest.mark.parametrize("dtype, smallest", [(torch.bfloat16, 0), (torch.float32, 8 << 20)])
def test_linear_kernels_leave_other_weights_alone(monkeypatch, dtype, smallest):
    """Only float32 CPU Linears whose weights stream from memory are dispatched: a bf16 model,
    or one a CPU cache holds, keeps its modules, nothing is measured."""
    from blockspec.targets import linear_kernels

    monkeypatch.delenv(linear_kernels.KERNEL_ENV, raising=False)
    monkeypatch.setattr(linear_kernels, "SMALLEST_WEIGHT_BYTES", smallest)
    monkeypatch.setattr(linear_kernels, "probe_linear_kernels", lambda *a, **k: pytest.fail("measured"))
    model = tiny_model("llama").to(dtype)
    assert linear_kernels.speed_up_linears(model) == {"kernels": {}, "source": "not-applicable"}
    assert not any(isinstance(m, RowDispatchLinear) for m in model.modules())


def test_linear_kernel_named_in_the_environment_is_applied_without_measuring(monkeypatch, tmp_path):
    from blockspec.targets import linear_kernels

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(linear_kernels, "probe_linear_kernels", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "weight-first")
    model = tiny_model("llama")
    choice = linear_kernels.speed_up_linears(model)
    assert choice == {"kernels": {rows: "weight-first" for rows in PROBE_ROWS}, "source": "env"}
    assert all(isinstance(m, RowDispatchLinear) and m.packed is None for m in model.modules()
               if isinstance(m, (torch.nn.Linear, RowDispatchLinear)))
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "linear")  # transformers' own: the modules stay
    model = tiny_model("llama")
    linear_kernels.speed_up_linears(model)
    assert not any(isinstance(m, RowDispatchLinear) for m in model.modules())
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "gemv")
    with pytest.raises(InvalidArgumentError, match="BLOCKSPEC_LINEAR_KERNEL='gemv'.*auto, linear, weight-first, onednn"):
        linear_kernels.choose_linear_kernels(tiny_model("llama"))


@pytest.mark.parametrize("times, expected", [
    ({1: {"linear": 1.0, "weight-first": 0.8, "onednn": 1.2}, 8: {"linear": 1.0, "weight-first": 0.95, "onednn": 0.6}},
     {1: "weight-first", 8: "onednn"}),
    # the fastest by less than GAIN_NEEDED: transformers' own stays
    ({1: {"linear": 1.0, "weight-first": 0.97, "onednn": 1.2}, 8: {"linear": 0.5, "weight-first": 0.9, "onednn": 0.6}},
     {1: "linear", 8: "linear"})])
def test_auto_linear_kernels_are_measured_once_per_machine_and_cached(monkeypatch, tmp_path, times, expected):
    """`auto` takes per probed width the kernel this machine measured clearly fastest; the
    answer is kept (atomically, in the cache dir) so later loads agree without a probe; another
    thread count is another question; a corrupt cache file is measured again."""
    from blockspec.targets import linear_kernels

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(linear_kernels.KERNEL_ENV, raising=False)
    monkeypatch.setattr(linear_kernels, "SMALLEST_WEIGHT_BYTES", 0)  # the tiny model as if it streamed
    probes = []
    monkeypatch.setattr(linear_kernels, "probe_linear_kernels", lambda shapes, kernels: probes.append(shapes) or times)
    model = tiny_model("llama")
    first = linear_kernels.speed_up_linears(model)
    assert first["kernels"] == expected and first["source"] == "measured"
    assert probes == [linear_kernels.linear_shapes(tiny_model("llama"))]
    dispatched = any(isinstance(m, RowDispatchLinear) for m in model.modules())
    assert dispatched == (set(expected.values()) != {"linear"})
    again = linear_kernels.choose_linear_kernels(tiny_model("llama"))
    assert again["kernels"] == expected and again["source"] == "cached" and len(probes) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert linear_kernels.choose_linear_kernels(tiny_model("llama"))["source"] == "measured"
    finally:
        torch.set_num_threads(threads)
    assert len(probes) == 2 and len(json.loads((tmp_path / "linear-kernels.json").read_text())) == 2
    (tmp_path / "linear-kernels.json").write_text("{not json")
    assert linear_kernels.choose_linear_kernels(tiny_model("llama"))["source"] == "measured"


def test_onednn_is_not_probed_where_its_second_copy_would_not_fit(monkeypatch, tmp_path):
    from blockspec.targets import linear_kernels

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(linear_kernels.KERNEL_ENV, raising=False)
    monkeypatch.setattr(linear_kernels, "SMALLEST_WEIGHT_BYTES", 0)
    monkeypatch.setattr(linear_kernels, "_memory_available", lambda: 1000)  # bytes: less than the weights
    probed = []
    monkeypatch.setattr(linear_kernels, "probe_linear_kernels", lambda shapes, kernels: probed.append(kernels) or
                        {1: {k: 1.0 for k in kernels}})
    linear_kernels.choose_linear_kernels(tiny_model("llama"))
    assert probed == [("linear", "weight-first")]


def test_linear_kernel_probe_times_every_kernel():
    """The real probe (tiny shapes, a MB): a positive, finite time per kernel and row count."""
    kernels = KERNELS if onednn_available() else ("linear", "weight-first")
    times = probe_linear_kernels([(96, 64), (64, 96)], kernels, rows=(1, 3), probe_bytes=1 << 20, repeats=2)
    assert set(times) == {1, 3} and all(set(by_kernel) == set(kernels) and all(0 < t < float("inf") for t in
                                                                                  by_kernel.values())
                                        for by_kernel in times.values())


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


@pytest.mark.parametrize("amx, avx512_bf16, speedup, expected", [
    (True, True, 0.5, True),     # AMX: bf16 steps, no probe needed
    (False, False, 3.0, False),  # no bf16 instructions at all: fp32, no probe
    (False, True, 0.6, False),   # AVX512-BF16 slower than fp32 (session 14's VM)
    (False, True, 2.2, True),    # AVX512-BF16 twice as fast (session 30's AMD EPYC)
])
def test_bf16_training_follows_what_the_cpu_measures(amx, avx512_bf16, speedup, expected, monkeypatch):
    """Without AMX, `train --precision auto` takes bf16 steps only where a probe measures bf16
    products clearly faster than fp32 ones: AVX512-BF16 chips differ both ways."""
    from blockspec.targets import loading

    probes = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(loading, "bf16_matmul_speedup", lambda: probes.append(1) or speedup)
    loading.cpu_trains_faster_in_bf16.cache_clear()
    try:
        assert loading.cpu_trains_faster_in_bf16() is expected
        assert len(probes) == (1 if avx512_bf16 and not amx else 0)
    finally:
        loading.cpu_trains_faster_in_bf16.cache_clear()


def test_bf16_probe_measures_a_ratio():
    from blockspec.targets import loading

    speedup = loading.bf16_matmul_speedup(rows=32, repeats=2)
    assert 0.01 < speedup < 100
