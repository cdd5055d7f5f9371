"""What vLLM and SGLang read from a DFlash drafter folder, pinned against what blockspec writes.

Neither engine can be installed here, so their readers are transcribed from source
(vLLM 0.33.0, SGLang 0.5.23; the speculators format as vLLM 0.33.0 converts it). The
requirement tables below are plain data; every row and every transcribed helper names
the engine, its version and the source file + function it comes from. The tests build
tiny drafters like tests/test_export.py does, save them natively and export them to
speculators, and check every field and weight the engines read: present, and with the
meaning the engine gives it.

Where blockspec writes something an engine would mis-read, the assertion is
`xfail(strict=True)` with the reason (so it turns into a failure once fixed): src/ is not
changed by this file.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockspec.drafters.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from blockspec.export.convert import export_drafter
from blockspec.targets.adapter import TargetAdapter
from conftest import tiny_model

VLLM = "vLLM 0.33.0"
SGLANG = "SGLang 0.5.23"
MISSING = object()

# ------------------------------------------------------------------------------------
# Requirement tables: (field of config.json, must blockspec write it?, the engine's value
# when the field is absent, source). "must write" = the engine has no default, or its
# default does not describe a blockspec drafter.
# ------------------------------------------------------------------------------------

# vLLM 0.33.0, native (reference) folder given as --speculative-config '{"method": "dflash", "model": DIR, ...}'.
# The folder's config.json is read by transformers (model_type -> Qwen3Config) and wrapped in
# EAGLEConfig(method="dflash") (vllm/config/speculative.py SpeculativeConfig.__post_init__), which keeps
# every attribute, unknown ones (dflash_config, draft_vocab_size) included.
VLLM_NATIVE_FIELDS = [
    # vllm/transformers_utils/configs/eagle.py EAGLEConfig.__init__ keeps names starting with "DFlash";
    # vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS["DFlashDraftModel"]
    #   -> ("qwen3_dflash", "DFlashQwen3ForCausalLM")
    ("architectures", True, None, "registry.py _SPECULATIVE_DECODING_MODELS"),
    # vllm/transformers_utils/config.py get_config: AutoConfig needs model_type ("qwen3" -> Qwen3Config)
    ("model_type", True, None, "transformers_utils/config.py get_config"),
    # vllm/model_executor/models/qwen3_dflash.py DFlashQwen3Model.__init__ / DFlashQwen3DecoderLayer.__init__
    ("hidden_size", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("num_hidden_layers", True, None, "qwen3_dflash.py DFlashQwen3Model.__init__ (one layer each)"),
    ("num_attention_heads", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("num_key_value_heads", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("head_dim", True, "hidden_size // num_attention_heads", "qwen3_dflash.py DFlashQwen3Attention.__init__"),
    ("intermediate_size", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__ (Qwen3MLP)"),
    ("rms_norm_eps", True, 1e-6, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("max_position_embeddings", True, 32768, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__ (get_rope)"),
    ("vocab_size", True, None, "qwen3_dflash.py DFlashQwen3ForCausalLM.compute_logits"),
    # qwen3_dflash.py DFlashQwen3DecoderLayer.__init__ -> set_default_rope_theta(config, default_theta=1000000)
    ("rope_parameters.rope_theta", True, 1_000_000, "transformers_utils/config.py set_default_rope_theta"),
    # vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config:
    #   aux ids = [i + 1 for i in dflash_config.target_layer_ids]; fc input = len(aux) * target_hidden_size
    ("dflash_config.target_layer_ids", True, None, "eagle3_utils.py get_eagle3_aux_layers_from_config"),
    # vllm/v1/spec_decode/llm_base_proposer.py SpecDecodeBaseProposer._init_parallel_drafting_params
    #   (dflash_config.mask_token_id, else top-level mask_token_id, else ValueError)
    ("dflash_config.mask_token_id", True, None, "llm_base_proposer.py _init_parallel_drafting_params"),
    # qwen3_dflash.py _resolve_layer_attention/_dflash_layer_causal: absent or "full_attention" -> non-causal
    ("layer_types", False, "all full attention", "qwen3_dflash.py _dflash_layer_causal"),
    ("hidden_act", False, "silu", "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__ (Qwen3MLP)"),
    ("attention_bias", False, False, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    # qwen3_dflash.py DFlashQwen3ForCausalLM.__init__: None -> vocab_size; != target vocab -> d2t parameter
    ("draft_vocab_size", False, "vocab_size", "qwen3_dflash.py DFlashQwen3ForCausalLM.__init__"),
    ("target_hidden_size", False, "hidden_size", "qwen3_dflash.py _get_dflash_fc_input_size"),
    ("dflash_config.use_aux_hidden_state", False, True, "qwen3_dflash.py DFlashQwen3Model.__init__"),
    ("dflash_config.causal", False, "from layer_types", "qwen3_dflash.py _dflash_layer_causal"),
    ("is_neox_style", False, True, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
]
# Not read by vLLM 0.33.0 for method "dflash": block_size (the query is 1 + num_speculative_tokens:
# vllm/v1/spec_decode/dflash.py DFlashProposer.__init__; num_speculative_tokens has no default for a
# native folder: vllm/config/speculative.py SpeculativeConfig.__post_init__), num_target_layers.
VLLM_NATIVE_NOT_READ = ["block_size", "num_target_layers", "blockspec_target"]

# vLLM 0.33.0, speculators folder (`vllm serve DIR`, or as the "model" of --speculative-config).
# vllm/transformers_utils/config.py get_config: no top-level model_type + a speculators_config -> "speculators";
# vllm/transformers_utils/configs/speculators/base.py SpeculatorsConfig.extract_transformers_pre_trained_config
# starts from transformer_layer_config and applies algos.py update_dflash.
VLLM_SPECULATORS_FIELDS = [
    ("speculators_model_type", True, None, "speculators/base.py extract_transformers_pre_trained_config"),
    ("transformer_layer_config", True, None, "speculators/base.py validate_speculators_config"),
    # speculators/algos.py update_dflash: KeyError if absent; -> eagle_aux_hidden_state_layer_ids and
    #   dflash_config.target_layer_ids = [i - 1 for i in aux]
    ("aux_hidden_state_layer_ids", True, None, "speculators/algos.py update_dflash"),
    ("mask_token_id", True, None, "speculators/algos.py update_dflash"),
    ("draft_vocab_size", False, "vocab_size", "speculators/algos.py update_dflash"),
    ("target_hidden_size", False, "hidden_size", "speculators/algos.py update_dflash"),
    ("sample_from_anchor", False, False, "speculators/algos.py update_dflash"),
    # speculators/algos.py update_dflash: dflash_config.causal = not sliding_window_non_causal (default True)
    ("sliding_window_non_causal", False, True, "speculators/algos.py update_dflash"),
    # speculators/base.py validate_speculators_config / build_vllm_speculative_config
    ("speculators_config.proposal_methods.0.speculative_tokens", True, None, "speculators/base.py build_vllm_speculative_config"),
    # vllm/transformers_utils/config.py maybe_override_with_speculators (`vllm serve DIR`: must be a hub repo id)
    ("speculators_config.verifier.name_or_path", True, None, "transformers_utils/config.py maybe_override_with_speculators"),
    ("transformer_layer_config.hidden_size", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.num_hidden_layers", True, None, "qwen3_dflash.py DFlashQwen3Model.__init__"),
    ("transformer_layer_config.num_attention_heads", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.num_key_value_heads", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.head_dim", True, None, "qwen3_dflash.py DFlashQwen3Attention.__init__"),
    ("transformer_layer_config.intermediate_size", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.hidden_act", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.rms_norm_eps", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.max_position_embeddings", True, None, "qwen3_dflash.py DFlashQwen3DecoderLayer.__init__"),
    ("transformer_layer_config.vocab_size", True, None, "qwen3_dflash.py DFlashQwen3ForCausalLM.compute_logits"),
    ("transformer_layer_config.rope_parameters.rope_theta", True, 1_000_000, "transformers_utils/config.py set_default_rope_theta"),
    ("transformer_layer_config.layer_types", False, "all full attention", "qwen3_dflash.py _resolve_layer_attention"),
]

# SGLang 0.5.23, native (reference) folder given as --speculative-draft-model-path with
# --speculative-algorithm DFLASH. SGLang has no reader for the speculators format.
SGLANG_NATIVE_FIELDS = [
    # sglang/srt/models/dflash.py EntryClass (class DFlashDraftModel); the model registry matches architectures
    ("architectures", True, None, "sglang/srt/models/dflash.py EntryClass"),
    ("model_type", True, None, "sglang/srt/utils/hf_transformers_utils get_config (AutoConfig)"),
    # sglang/srt/speculative/dflash_utils.py DFlashDraftConfig.require_num_layers: ValueError if absent
    ("num_hidden_layers", True, None, "dflash_utils.py parse_dflash_draft_config / require_num_layers"),
    ("hidden_size", True, None, "sglang/srt/models/dflash.py DFlashDraftModel.__init__"),
    ("num_attention_heads", True, None, "sglang/srt/models/dflash.py DFlashAttention.__init__"),
    ("num_key_value_heads", True, "num_attention_heads", "sglang/srt/models/dflash.py DFlashAttention.__init__"),
    ("head_dim", True, "hidden_size // num_attention_heads", "sglang/srt/models/dflash.py DFlashAttention.__init__"),
    # sglang/srt/models/dflash.py DFlashMLP.__init__: ValueError unless > 0
    ("intermediate_size", True, None, "sglang/srt/models/dflash.py DFlashMLP.__init__"),
    ("rms_norm_eps", True, 1e-6, "sglang/srt/models/dflash.py DFlashDraftModel.__init__"),
    ("max_position_embeddings", True, 32768, "sglang/srt/models/dflash.py DFlashAttention.__init__"),
    # sglang/srt/utils/hf_transformers/common.py get_rope_config: rope_parameters.rope_theta, else rope_theta, else 10000
    ("rope_parameters.rope_theta", True, 10000, "hf_transformers/common.py get_rope_config"),
    # dflash_utils.py parse_dflash_draft_config: dflash_config.block_size, else top-level block_size;
    # sglang/srt/arg_groups/speculative_hook.py _handle_dflash: default --speculative-num-draft-tokens (else 16)
    ("block_size", True, 16, "arg_groups/speculative_hook.py _handle_dflash"),
    # dflash_utils.py DFlashDraftConfig.resolve_target_layer_ids: absent -> build_target_layer_ids(L, n)
    ("dflash_config.target_layer_ids", True, "build_target_layer_ids", "dflash_utils.py resolve_target_layer_ids"),
    # sglang/srt/speculative/dflash_worker_v2.py DFlashWorkerV2._resolve_mask_token_id: absent -> the
    # tokenizer's "<|MASK|>" token, ADDED to the tokenizer when missing (needs a resized embedding: error)
    ("dflash_config.mask_token_id", True, "tokenizer '<|MASK|>'", "dflash_worker_v2.py _resolve_mask_token_id"),
    # dflash_utils.py parse_dflash_draft_config (dflash_config or top level): only a warning if != runtime target
    ("num_target_layers", False, None, "model_runner_components/spec_aux_hidden_state.py _resolve_dflash_aux_hidden_state"),
    # sglang/srt/models/dflash.py _get_dflash_layer_attention_params: None -> all non-causal (ENCODER_ONLY);
    # present -> one entry per draft layer, "full_attention" -> non-causal unless is_causal
    ("layer_types", False, "all non-causal", "sglang/srt/models/dflash.py _get_dflash_layer_attention_params"),
    ("dflash_config.mask_token", False, "<|MASK|>", "dflash_utils.py parse_dflash_draft_config"),
    ("hidden_act", False, "silu", "sglang/srt/models/dflash.py DFlashMLP.__init__"),
    ("attention_bias", False, False, "sglang/srt/models/dflash.py DFlashAttention.__init__"),
]
# Not read by SGLang 0.5.23 DFLASH: draft_vocab_size (it always drafts over the target's full LM head:
# dflash_worker_v2.py), and the `d2t` tensor is skipped ("Ignore unexpected weights":
# sglang/srt/models/dflash.py DFlashDraftModel.load_weights).
SGLANG_NOT_READ = ["draft_vocab_size", "blockspec_target"]

# Weight names. vLLM 0.33.0 qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights: skips names containing
# "t2d"; "d2t" -> draft_id_to_target_id; names without "lm_head" get "model."; then
# DFlashQwen3Model.hf_to_vllm_mapper stacks q/k/v -> qkv_proj and gate/up -> gate_up_proj; an unknown
# name raises ("There is no module or parameter named ...": model_executor/models/utils.py AutoWeightsLoader).
VLLM_STACKED = [(".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
                (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)]
# SGLang 0.5.23 sglang/srt/models/dflash.py DFlashDraftModel.load_weights: (param, checkpoint part, shard),
# matched on f".{part}."; names are looked up as is, without/with "model.", or via the encoder.* aliases;
# an unknown name is SKIPPED silently.
SGLANG_STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
SGLANG_ENCODER_ALIASES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}

# ------------------------------------------------------------------------------------
# Reasons of the known mismatches (xfail strict)
# ------------------------------------------------------------------------------------
R_D2T = ("vLLM 0.33.0 qwen3_dflash.py DFlashQwen3ForCausalLM.compute_logits maps draft index i to target id "
         "i + d2t[i] (d2t = OFFSETS, the EAGLE-3/speculators convention); blockspec's native folder stores d2t "
         "as ABSOLUTE target ids, so vLLM would place the draft logits at wrong (or out-of-range) ids. "
         "`blockspec export --to speculators` writes offsets.")
R_HEAD = ("vLLM 0.33.0: without lm_head.weight in the checkpoint the draft shares the target's full head "
          "(llm_base_proposer.py _maybe_share_lm_head) and LogitsProcessor(draft_vocab_size) keeps its FIRST "
          "draft_vocab_size columns (target ids 0..dv-1), not the d2t rows; the native folder with "
          "draft_vocab_size ships no lm_head.weight (the speculators export does).")
R_CAUSAL = ("vLLM 0.33.0 speculators/algos.py update_dflash sets dflash_config.causal = not "
            "sliding_window_non_causal, and qwen3_dflash.py _dflash_layer_causal applies that override to EVERY "
            "layer, full-attention ones included; blockspec's speculators export writes "
            "sliding_window_non_causal=false, so vLLM would attend causally inside the block although the "
            "drafter was trained bidirectionally. `true` (or leaving it out) is neutral for speculators itself, "
            "where it only concerns sliding-window layers (blockspec has none).")
R_LAST_EXPORT = ("target_layer_ids holds num_target_layers-1: the speculators export drops that id from "
                 "aux_hidden_state_layer_ids (as the speculators converter does) but keeps fc.weight at its full "
                 "width, so vLLM 0.33.0 builds fc for len(aux)*hidden inputs (qwen3_dflash.py "
                 "_get_dflash_fc_input_size) and the weight load fails on the shape.")
R_LAST_SGLANG = ("SGLang 0.5.23 captures 'before layer id+1' inside the target's layer loop (qwen3.py/llama.py "
                 "set_dflash_layers_to_capture, qwen2.py/llama.py Model.forward): id num_target_layers-1 is never "
                 "captured, so the features are narrower than fc (ValueError in "
                 "models/dflash.py DFlashDraftModel.project_target_hidden).")
R_LAST_FEATURE = ("layer id L-1: blockspec uses HF hidden_states[L], which transformers replaces by the "
                  "post-final-norm last_hidden_state (transformers/utils/output_capturing.py capture_outputs, "
                  "tie_last_hidden_states); vLLM 0.33.0's aux id L is the pre-norm residual stream "
                  "(interfaces.py EagleModelMixin._maybe_add_hidden_state) and SGLang never captures it.")
R_DUPLICATE = ("default_target_layer_ids repeats ids when num_target_layers - 4 < num_draft_layers - 1; "
               "vLLM 0.33.0 (interfaces.py EagleModelMixin._set_aux_hidden_state_layers: sorted(set(...))) and "
               "SGLang 0.5.23 (`i in layers_to_capture`) capture each layer once: fewer features than fc's width.")


# ------------------------------------------------------------------------------------
# Transcriptions of the engines' readers (pure Python over config dicts and tensor names)
# ------------------------------------------------------------------------------------

def field(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return MISSING
    return value


def vllm_speculators_to_hf(config: dict) -> dict:
    """vLLM 0.33.0 transformers_utils/configs/speculators/base.py extract_transformers_pre_trained_config +
    algos.py update_dflash: the draft hf_config vLLM builds from a speculators config.json."""
    assert config.get("speculators_model_type") == "dflash"
    hf = {k: v for k, v in dict(config.get("transformer_layer_config", {})).items() if k != "model_type"}
    hf["architectures"] = ["DFlashDraftModel"]
    hf["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        hf["target_hidden_size"] = config["target_hidden_size"]
    aux = config["aux_hidden_state_layer_ids"]
    hf["eagle_aux_hidden_state_layer_ids"] = aux
    hf["dflash_config"] = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                           "sample_from_anchor": config.get("sample_from_anchor", False)}
    hf["dflash_config"]["causal"] = not config.get("sliding_window_non_causal", True)
    return hf


def vllm_validate_speculators(config: dict) -> dict:
    """vLLM 0.33.0 speculators/base.py validate_speculators_config + build_vllm_speculative_config."""
    spec = config["speculators_config"]
    first = spec["proposal_methods"][0]
    assert isinstance(spec["verifier"]["name_or_path"], str)
    assert isinstance(config["transformer_layer_config"], dict)
    method = config["speculators_model_type"]
    return {"method": "dflash" if method == "dflash2" else method, "num_speculative_tokens": first["speculative_tokens"]}


def vllm_aux_layers(hf: dict) -> list[int] | None:
    """vLLM 0.33.0 v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config."""
    layer_ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if not layer_ids and isinstance(hf.get("dflash_config"), dict):
        layer_ids = [i + 1 for i in (hf["dflash_config"].get("target_layer_ids") or [])]
    if not layer_ids and hf.get("target_layer_ids"):
        layer_ids = [i + 1 for i in hf["target_layer_ids"]]
    return list(layer_ids) if layer_ids else None


def vllm_fc_input_size(hf: dict) -> int:
    """vLLM 0.33.0 qwen3_dflash.py _get_dflash_fc_input_size (aux ids counted as listed)."""
    aux = vllm_aux_layers(hf)
    count = len(aux) if aux else hf["num_hidden_layers"]
    return (hf.get("target_hidden_size") or hf["hidden_size"]) * count


def vllm_captured(aux: list[int], num_target_layers: int) -> list[int]:
    """vLLM 0.33.0 model_executor/models/interfaces.py EagleModelMixin: aux_hidden_state_layers =
    sorted(set(layers)); qwen2.py/llama.py Model.forward capture index 0 (embeddings) and idx + 1 after
    decoder layer idx, i.e. 0..L."""
    return [k for k in sorted(set(aux)) if 0 <= k <= num_target_layers]


def vllm_layer_causal(hf: dict, layer: int) -> bool:
    """vLLM 0.33.0 qwen3_dflash.py _dflash_layer_causal."""
    if hf.get("is_causal") is not None:
        return bool(hf["is_causal"])
    override = (hf.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    layer_types = hf.get("layer_types")
    return bool(layer_types) and layer_types[layer] == "sliding_attention"


def vllm_mask_token_id(hf: dict) -> int:
    """vLLM 0.33.0 v1/spec_decode/llm_base_proposer.py SpecDecodeBaseProposer._init_parallel_drafting_params."""
    dflash = hf.get("dflash_config")
    if dflash and "mask_token_id" in dflash:
        return dflash["mask_token_id"]
    if hf.get("mask_token_id") is not None:
        return hf["mask_token_id"]
    raise ValueError("no mask token id")


def vllm_rope_theta(hf: dict) -> float:
    """vLLM 0.33.0 transformers_utils/config.py set_default_rope_theta(config, default_theta=1000000)."""
    return (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000)


def vllm_draft_vocab_size(hf: dict) -> int:
    """vLLM 0.33.0 qwen3_dflash.py DFlashQwen3ForCausalLM.__init__."""
    return hf.get("draft_vocab_size") or hf["vocab_size"]


def vllm_expected_shapes(hf: dict, target_vocab: int) -> dict[tuple[str, object], list[int]]:
    """(vLLM parameter, shard) -> the checkpoint tensor shape its weight loader takes (unsharded)."""
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    shapes = {("model.fc.weight", None): [hidden, vllm_fc_input_size(hf)],
              ("model.hidden_norm.weight", None): [hidden], ("model.norm.weight", None): [hidden]}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {(p + "self_attn.qkv_proj.weight", "q"): [heads * head_dim, hidden],
                   (p + "self_attn.qkv_proj.weight", "k"): [kv_heads * head_dim, hidden],
                   (p + "self_attn.qkv_proj.weight", "v"): [kv_heads * head_dim, hidden],
                   (p + "self_attn.o_proj.weight", None): [hidden, heads * head_dim],
                   (p + "self_attn.q_norm.weight", None): [head_dim], (p + "self_attn.k_norm.weight", None): [head_dim],
                   (p + "input_layernorm.weight", None): [hidden], (p + "post_attention_layernorm.weight", None): [hidden],
                   (p + "mlp.gate_up_proj.weight", 0): [inter, hidden], (p + "mlp.gate_up_proj.weight", 1): [inter, hidden],
                   (p + "mlp.down_proj.weight", None): [hidden, inter]}
    draft_vocab = vllm_draft_vocab_size(hf)
    # lm_head (ParallelLMHead(draft_vocab_size, hidden)) and model.embed_tokens: shared from the target
    # when the checkpoint lacks them (llm_base_proposer.py _maybe_share_lm_head / embeddings sharing)
    shapes[("lm_head.weight", None)] = [draft_vocab, hidden]
    shapes[("model.embed_tokens.weight", None)] = [hf["vocab_size"], hidden]
    if draft_vocab != target_vocab:
        shapes[("draft_id_to_target_id", None)] = [draft_vocab]
    return shapes


VLLM_FROM_TARGET = {("lm_head.weight", None), ("model.embed_tokens.weight", None)}


def vllm_map_weight(name: str) -> tuple[str, object] | None:
    """vLLM 0.33.0 qwen3_dflash.py DFlashQwen3ForCausalLM.load_weights + DFlashQwen3Model.hf_to_vllm_mapper."""
    assert "mask_hidden" not in name  # asserted by load_weights
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    for alias, real in (("encoder.output_norm_enc", "hidden_norm"), ("encoder.fc", "fc")):
        name = name.replace(alias, real)
    for old, new, shard in VLLM_STACKED:
        if old in name:
            return name.replace(old, new), shard
    return name, None


def sglang_parse(config: dict) -> dict:
    """SGLang 0.5.23 sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config (the DFLASH fields)."""
    dflash = config.get("dflash_config") or {}
    mask_token_id = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask_token_id is not None:
        assert isinstance(mask_token_id, int) and not isinstance(mask_token_id, bool) and mask_token_id >= 0
    return {"num_hidden_layers": config.get("num_hidden_layers"),
            "num_target_layers": dflash.get("num_target_layers", config.get("num_target_layers")),
            "block_size": dflash.get("block_size", config.get("block_size")),
            "target_layer_ids": dflash.get("target_layer_ids", config.get("target_layer_ids")),
            "mask_token": dflash.get("mask_token", config.get("mask_token")) or "<|MASK|>",
            "mask_token_id": mask_token_id}


def sglang_build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang 0.5.23 dflash_utils.py build_target_layer_ids (the default when the config has no ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def sglang_target_layer_ids(parsed: dict, num_target_layers: int) -> list[int]:
    """SGLang 0.5.23 dflash_utils.py DFlashDraftConfig.resolve_target_layer_ids."""
    ids = parsed["target_layer_ids"]
    if ids is None:
        return sglang_build_target_layer_ids(num_target_layers, parsed["num_hidden_layers"])
    assert ids and all(0 <= i < num_target_layers for i in ids), "out-of-range layer id: ValueError"
    return list(ids)


def sglang_captured(ids: list[int], num_target_layers: int) -> list[int]:
    """SGLang 0.5.23 models/qwen3.py (llama.py) set_dflash_layers_to_capture: layers_to_capture = ids + 1;
    models/qwen2.py (llama.py) Model.forward captures the input of layer i for i in range(start, end)."""
    capture = [i + 1 for i in ids]
    return [i for i in range(num_target_layers) if i in capture]


def sglang_layer_non_causal(config: dict, layer: int) -> bool:
    """SGLang 0.5.23 models/dflash.py _get_dflash_layer_attention_params (ENCODER_ONLY = non-causal)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return True
    assert layer < len(layer_types), "layer_types must have one entry per draft layer: ValueError"
    if layer_types[layer] == "full_attention":
        return not config.get("is_causal", False)
    return bool(config.get("is_causal") is False)  # sliding_attention: DECODER unless is_causal is False


def sglang_rope_theta(config: dict) -> float:
    """SGLang 0.5.23 sglang/srt/utils/hf_transformers/common.py get_rope_config."""
    params = config.get("rope_parameters")
    if params is not None:
        return params.get("rope_theta", config.get("rope_theta", 10000))
    return config.get("rope_theta", 10000)


def sglang_expected_shapes(config: dict, num_context_features: int) -> dict[tuple[str, object], list[int]]:
    """SGLang 0.5.23 models/dflash.py DFlashDraftModel (params, no "model." prefix) -> checkpoint shapes."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {("fc.weight", None): [hidden, num_context_features * hidden],  # checked exactly in load_weights
              ("hidden_norm.weight", None): [hidden], ("norm.weight", None): [hidden]}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {(p + "self_attn.qkv_proj.weight", "q"): [heads * head_dim, hidden],
                   (p + "self_attn.qkv_proj.weight", "k"): [kv_heads * head_dim, hidden],
                   (p + "self_attn.qkv_proj.weight", "v"): [kv_heads * head_dim, hidden],
                   (p + "self_attn.o_proj.weight", None): [hidden, heads * head_dim],
                   (p + "self_attn.q_norm.weight", None): [head_dim], (p + "self_attn.k_norm.weight", None): [head_dim],
                   (p + "input_layernorm.weight", None): [hidden], (p + "post_attention_layernorm.weight", None): [hidden],
                   (p + "mlp.gate_up_proj.weight", 0): [inter, hidden], (p + "mlp.gate_up_proj.weight", 1): [inter, hidden],
                   (p + "mlp.down_proj.weight", None): [hidden, inter]}
    return shapes


def sglang_map_weight(name: str, params: set[str]) -> tuple[str, object] | None:
    """SGLang 0.5.23 models/dflash.py DFlashDraftModel.load_weights (None: skipped silently)."""

    def resolve(candidate: str) -> str | None:
        if candidate in params:
            return candidate
        if candidate.startswith("model.") and candidate[len("model."):] in params:
            return candidate[len("model."):]
        if not candidate.startswith("model.") and f"model.{candidate}" in params:
            return f"model.{candidate}"
        alias = SGLANG_ENCODER_ALIASES.get(candidate)
        return alias if alias in params else None

    for param, part, shard in SGLANG_STACKED:
        if f".{part}." in name:
            resolved = resolve(name.replace(part, param))
            if resolved is not None:
                return resolved, shard
    resolved = resolve(name)
    return None if resolved is None else (resolved, None)


# ------------------------------------------------------------------------------------
# Drafters: built like tests/test_export.py random_drafter, saved natively, exported to speculators
# ------------------------------------------------------------------------------------

L = 4  # layers of the tiny target
DRAFTERS = {
    # ids within 0..L-2, strictly increasing: what both engines can reproduce
    "portable": dict(target_layer_ids=[0, 1, 2], draft_vocab_size=None),
    "portable-reduced-vocab": dict(target_layer_ids=[0, 1, 2], draft_vocab_size=40),
    # tests/test_export.py random_drafter's ids: the last target layer included
    "last-layer": dict(target_layer_ids=[0, 2, 3], draft_vocab_size=None),
}


@pytest.fixture(scope="module")
def target():
    return TargetAdapter(tiny_model("llama", layers=L), tokenizer=None, name="tiny-llama")


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-fields")
    made = {}
    for index, (kind, spec) in enumerate(DRAFTERS.items()):
        torch.manual_seed(index)
        config = DFlashConfig.for_target(target, num_layers=2, block_size=8, mask_token_id=target.vocab_size - 1,
                                         target_layer_ids=spec["target_layer_ids"])
        config.draft_vocab_size = spec["draft_vocab_size"]
        model = DFlashDraftModel(config)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    parameter.normal_(0, 0.3)
            if config.draft_vocab_size:
                model.d2t.copy_(torch.randperm(target.vocab_size)[:config.draft_vocab_size].sort().values)
                model.stored_head = model.head(target)[0].detach().clone()  # as blockspec train does
        model.save_pretrained(root / kind / "native")
        if kind != "last-layer":  # refused: see test_speculators_export_refuses_the_last_target_layer
            export_drafter(root / kind / "native", "speculators", root / kind / "spec", target=target,
                           verifier="org/target")
        made[kind] = {"model": model, "native": root / kind / "native", "spec": root / kind / "spec"}
    return made


def read(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def check_weights(tensors: dict[str, torch.Tensor], mapper, expected: dict, from_elsewhere: set, engine: str):
    """Every checkpoint tensor lands on an engine parameter with the shape its loader takes, and every
    parameter the engine does not borrow from the target is covered."""
    loaded = {}
    for name, tensor in tensors.items():
        mapped = mapper(name)
        if mapped is None:
            continue
        assert mapped in expected, f"{engine}: checkpoint weight {name!r} -> {mapped} is not a parameter"
        assert list(tensor.shape) == expected[mapped], f"{engine}: {name} {list(tensor.shape)} != {expected[mapped]}"
        loaded[mapped] = name
    missing = set(expected) - set(loaded) - from_elsewhere
    assert not missing, f"{engine}: parameters no checkpoint weight fills: {sorted(missing, key=str)}"
    return loaded


# ------------------------------------------------------------------------------------
# The tables: every field an engine needs from us is written
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", [r for r in VLLM_NATIVE_FIELDS if r[1]], ids=lambda r: r[0])
def test_vllm_native_fields_present(folders, row):
    config, _ = read(folders["portable"]["native"])
    assert field(config, row[0]) is not MISSING, f"{VLLM} needs `{row[0]}` ({row[3]})"


@pytest.mark.parametrize("row", [r for r in VLLM_SPECULATORS_FIELDS if r[1]], ids=lambda r: r[0])
def test_vllm_speculators_fields_present(folders, row):
    config, _ = read(folders["portable"]["spec"])
    assert field(config, row[0]) is not MISSING, f"{VLLM} needs `{row[0]}` ({row[3]})"


@pytest.mark.parametrize("row", [r for r in SGLANG_NATIVE_FIELDS if r[1]], ids=lambda r: r[0])
def test_sglang_native_fields_present(folders, row):
    config, _ = read(folders["portable"]["native"])
    assert field(config, row[0]) is not MISSING, f"{SGLANG} needs `{row[0]}` ({row[3]})"


# ------------------------------------------------------------------------------------
# vLLM 0.33.0, native folder
# ------------------------------------------------------------------------------------

def test_vllm_native_config_means_what_we_trained(folders, target):
    drafter = folders["portable"]
    hf, tensors = read(drafter["native"])
    ours = drafter["model"].config
    assert "DFlashDraftModel" in hf["architectures"] and hf["model_type"] == "qwen3"
    # layer ids: ours = z-lab reference (id i = hidden_states[i + 1]); vLLM adds 1 to get its capture index
    aux = vllm_aux_layers(hf)
    assert aux == [i + 1 for i in ours.target_layer_ids]
    assert vllm_captured(aux, target.num_layers) == aux  # each id captured once, in our order
    assert vllm_fc_input_size(hf) == tensors["fc.weight"].shape[1] == len(ours.target_layer_ids) * target.hidden_size
    assert vllm_mask_token_id(hf) == ours.mask_token_id and 0 <= ours.mask_token_id < target.vocab_size
    assert vllm_rope_theta(hf) == target.rope_theta == ours.rope_theta  # vLLM's default would be 1e6
    assert not any(vllm_layer_causal(hf, i) for i in range(hf["num_hidden_layers"]))  # bidirectional block
    assert vllm_draft_vocab_size(hf) == target.vocab_size  # full vocabulary: no d2t parameter in vLLM
    assert hf.get("target_hidden_size", hf["hidden_size"]) == target.hidden_size
    assert (hf.get("dflash_config") or {}).get("use_aux_hidden_state", True) is True
    assert hf.get("is_neox_style", True) is True  # our RoPE rotates halves (neox layout)


@pytest.mark.parametrize("kind", ["portable", "portable-reduced-vocab"])
def test_vllm_native_weight_names_and_shapes(folders, target, kind):
    hf, tensors = read(folders[kind]["native"])
    loaded = check_weights(tensors, vllm_map_weight, vllm_expected_shapes(hf, target.vocab_size),
                           VLLM_FROM_TARGET, VLLM)
    # no embedding of our own; a head only for a reduced vocabulary (its rows of the target's), otherwise
    # vLLM shares the target's (llm_base_proposer.py _maybe_share_lm_head)
    reduced = bool(hf.get("draft_vocab_size"))
    assert VLLM_FROM_TARGET & set(loaded) == ({("lm_head.weight", None)} if reduced else set())
    assert ("d2t" in tensors) == (vllm_draft_vocab_size(hf) != target.vocab_size)


def test_vllm_native_reduced_vocab_d2t_convention(folders):
    drafter = folders["portable-reduced-vocab"]
    _, tensors = read(drafter["native"])
    d2t = tensors["d2t"]
    # qwen3_dflash.py DFlashQwen3ForCausalLM.compute_logits: targets = arange(draft_vocab_size) + d2t
    assert torch.equal(torch.arange(d2t.numel()) + d2t, drafter["model"].d2t)


def test_vllm_native_reduced_vocab_ships_its_head(folders, target):
    drafter = folders["portable-reduced-vocab"]
    _, tensors = read(drafter["native"])
    torch.testing.assert_close(tensors["lm_head.weight"], target.lm_head.weight[drafter["model"].d2t])


# ------------------------------------------------------------------------------------
# vLLM 0.33.0, speculators export
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["portable", "portable-reduced-vocab"])
def test_vllm_speculators_config_converts_back_to_ours(folders, target, kind):
    drafter = folders[kind]
    config, tensors = read(drafter["spec"])
    ours = drafter["model"].config
    # vllm/transformers_utils/config.py get_config: detected as "speculators" only without a model_type
    assert config.get("model_type", "speculators") == "speculators"
    assert vllm_validate_speculators(config) == {"method": "dflash", "num_speculative_tokens": ours.block_size - 1}
    hf = vllm_speculators_to_hf(config)
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"]["target_layer_ids"] == ours.target_layer_ids  # speculators ids - 1 = ours
    assert hf["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ours.target_layer_ids]
    assert vllm_captured(vllm_aux_layers(hf), target.num_layers) == vllm_aux_layers(hf)
    assert vllm_fc_input_size(hf) == tensors["fc.weight"].shape[1]
    assert vllm_mask_token_id(hf) == ours.mask_token_id
    assert vllm_rope_theta(hf) == target.rope_theta
    assert vllm_draft_vocab_size(hf) == (ours.draft_vocab_size or target.vocab_size)
    assert hf["dflash_config"]["sample_from_anchor"] is False  # anchor = bonus token, B-1 drafts
    assert hf.get("target_hidden_size", hf["hidden_size"]) == target.hidden_size
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "rms_norm_eps", "num_hidden_layers", "vocab_size"):
        assert hf[name] == getattr(ours, name), name


@pytest.mark.parametrize("kind", ["portable", "portable-reduced-vocab"])
def test_vllm_speculators_weight_names_and_shapes(folders, target, kind):
    drafter = folders[kind]
    config, tensors = read(drafter["spec"])
    hf = vllm_speculators_to_hf(config)
    loaded = check_weights(tensors, vllm_map_weight, vllm_expected_shapes(hf, target.vocab_size),
                           VLLM_FROM_TARGET, VLLM)
    assert ("model.embed_tokens.weight", None) not in loaded  # borrowed from the target
    if drafter["model"].config.draft_vocab_size:
        # the reduced head ships (has_own_lm_head) and d2t holds offsets, as compute_logits reads them
        assert ("lm_head.weight", None) in loaded
        targets = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
        assert torch.equal(targets, drafter["model"].d2t)
        torch.testing.assert_close(tensors["lm_head.weight"], target.lm_head.weight[targets])
    else:
        assert not {"d2t", "t2d", "lm_head.weight"} & set(tensors)


def test_vllm_speculators_block_attention_is_bidirectional(folders):
    config, _ = read(folders["portable"]["spec"])
    hf = vllm_speculators_to_hf(config)
    assert not any(vllm_layer_causal(hf, i) for i in range(hf["num_hidden_layers"]))


def test_speculators_export_refuses_the_last_target_layer(folders, target, tmp_path):
    # R_LAST_EXPORT: an aux list without the last layer would not match fc's width in vLLM
    from blockspec.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="last layer"):
        export_drafter(folders["last-layer"]["native"], "speculators", tmp_path / "spec", target=target)


def test_check_drafter_flags_what_the_engines_would_misread(folders, target):
    from blockspec.export.check import check_drafter

    assert check_drafter(folders["portable"]["native"], target) == []
    assert check_drafter(folders["portable-reduced-vocab"]["native"], target) == []
    assert any("last layer" in problem for problem in check_drafter(folders["last-layer"]["native"], target))


# ------------------------------------------------------------------------------------
# SGLang 0.5.23, native folder
# ------------------------------------------------------------------------------------

def test_sglang_native_config_means_what_we_trained(folders, target):
    drafter = folders["portable"]
    config, tensors = read(drafter["native"])
    ours = drafter["model"].config
    assert "DFlashDraftModel" in config["architectures"]
    parsed = sglang_parse(config)
    assert parsed["num_hidden_layers"] == ours.num_hidden_layers
    assert parsed["num_target_layers"] == target.num_layers  # else only a warning
    # --speculative-num-draft-tokens defaults to block_size: anchor + (B - 1) masks, our block exactly
    assert parsed["block_size"] == ours.block_size
    assert parsed["mask_token_id"] == ours.mask_token_id < target.vocab_size  # dflash_worker_v2.py range check
    ids = sglang_target_layer_ids(parsed, target.num_layers)
    assert ids == ours.target_layer_ids
    assert sglang_captured(ids, target.num_layers) == [i + 1 for i in ids]  # each id captured, in our order
    assert tensors["fc.weight"].shape[1] == len(ids) * ours.hidden_size  # num_context_features * hidden
    assert sglang_rope_theta(config) == target.rope_theta  # SGLang's default would be 10000
    assert all(sglang_layer_non_causal(config, i) for i in range(ours.num_hidden_layers))


@pytest.mark.parametrize("kind", ["portable", "portable-reduced-vocab"])
def test_sglang_native_weight_names_and_shapes(folders, kind):
    config, tensors = read(folders[kind]["native"])
    ids = sglang_target_layer_ids(sglang_parse(config), config["num_target_layers"])
    expected = sglang_expected_shapes(config, len(ids))
    params = {name for name, _ in expected}
    check_weights(tensors, lambda name: sglang_map_weight(name, params), expected, set(), SGLANG)
    skipped = {name for name in tensors if sglang_map_weight(name, params) is None}
    # only the reduced vocabulary's map and head rows are skipped: SGLang drafts over the target's full head
    assert skipped == ({"d2t", "lm_head.weight"} if config.get("draft_vocab_size") else set())


@pytest.mark.parametrize("kind", ["portable", pytest.param("last-layer", marks=pytest.mark.xfail(
    strict=True, reason=R_LAST_SGLANG))])
def test_sglang_captures_every_target_layer_id(folders, target, kind):
    config, tensors = read(folders[kind]["native"])
    ids = sglang_target_layer_ids(sglang_parse(config), target.num_layers)
    assert len(sglang_captured(ids, target.num_layers)) * config["hidden_size"] == tensors["fc.weight"].shape[1]


# ------------------------------------------------------------------------------------
# The layer-id convention: ours (z-lab reference) id i = hidden_states[i + 1] = the output of
# decoder layer i, which is what vLLM's aux id i + 1 and SGLang's capture before layer i + 1 hold
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer_id", [pytest.param(i, marks=pytest.mark.xfail(strict=True, reason=R_LAST_FEATURE))
                                      if i == L - 1 else i for i in range(L)])
def test_feature_of_layer_id_is_what_the_engines_capture(target, layer_id):
    outputs = {}

    def keep(index):
        def hook(module, args, output):
            outputs[index] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        return hook

    layers = target.model.model.layers
    handles = [layer.register_forward_hook(keep(k)) for k, layer in enumerate(layers)]
    try:
        target.reset()
        features = target.forward(torch.tensor([5, 9, 13, 7, 3]), layer_ids=(layer_id,)).features
    finally:
        for handle in handles:
            handle.remove()
        target.reset()
    # the residual stream after decoder layer `layer_id` (vLLM: hidden_states + residual after that layer;
    # SGLang: the input of layer layer_id + 1)
    torch.testing.assert_close(features, outputs[layer_id][0])


@pytest.mark.parametrize("num_target_layers, num_draft_layers", [
    (30, 2), (28, 5), (36, 5), (64, 8), (24, 1),
])
def test_default_target_layer_ids_are_engine_safe(num_target_layers, num_draft_layers):
    ids = default_target_layer_ids(num_target_layers, num_draft_layers)
    # SGLang's own default (used when a config has no ids) is the same rule
    assert ids == sglang_build_target_layer_ids(num_target_layers, num_draft_layers)
    # both engines capture each layer once, in ascending order, and only ids <= L - 2
    assert ids == sorted(set(ids)) and max(ids) <= num_target_layers - 2


def test_default_target_layer_ids_never_repeat_on_shallow_targets():
    # R_DUPLICATE: the reference rule repeats ids when L - 4 < n - 1; ours drops the repeats
    for num_target_layers in range(3, 8):
        for num_draft_layers in range(1, 6):
            ids = default_target_layer_ids(num_target_layers, num_draft_layers)
            assert ids == sorted(set(ids)) and 0 <= min(ids) and max(ids) <= num_target_layers - 2
