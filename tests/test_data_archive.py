"""Campaign data that outlives the machine (issue 13): a `blockspec data` folder packed to its
token ids alone and restored by one prefill pass that recomputes what regeneration stored."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
from safetensors.torch import load_file

from blockspec.errors import InvalidArgumentError
from blockspec.training.archive import pack_dataset, restore_dataset
from blockspec.training.data import load_records, write_shard_features, write_shard_topk
from blockspec.training.regenerate import generate_batch
from conftest import tiny_target

LAYERS, TOP_K = [0, 2], 4


def written_dataset(target, folder, prompts, shard_size=2):
    """A folder as `blockspec data --feature-layers 0,2 --store-topk 4` writes it (a tiny target has
    no tokenizer, so the shards are written here from the same decoder and writers)."""
    folder.mkdir()
    config = {"feature_layers": LAYERS, "store_topk": TOP_K, "shard_size": shard_size}
    (folder / "meta.json").write_text(json.dumps({"config": config, "target": target.fingerprint()}))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(len(prompts))))
    for shard, start in enumerate(range(0, len(prompts), shard_size)):
        chunk = prompts[start:start + shard_size]
        responses, features, top = generate_batch(target.model, chunk, 12, (95,), feature_layers=LAYERS, top_k=TOP_K)
        write_shard_features(folder, shard, dict(enumerate(features)))
        write_shard_topk(folder, shard, dict(enumerate(top)))
        (folder / f"shard-{shard:05d}.jsonl").write_text(
            "".join(json.dumps({"prompt_ids": p, "response_ids": r}) + "\n" for p, r in zip(chunk, responses)))
    return folder


PROMPTS = [[5, 17, 33, 2, 9], [40, 3], [7, 7, 8, 1, 22, 30, 11], [12, 60, 4]]


def test_a_restored_dataset_holds_the_features_and_top_k_regeneration_stored(tmp_path):
    target = tiny_target("llama")
    original = written_dataset(target, tmp_path / "regen", PROMPTS)
    archive = pack_dataset(original, tmp_path / "archive" / "regen.tar.xz")
    with tarfile.open(archive) as tar:  # token ids only: no features travel
        assert sorted(tar.getnames()) == ["meta.json", "prompts.jsonl", "shard-00000.jsonl", "shard-00001.jsonl"]
    restored = restore_dataset(archive, tmp_path / "restored", target, batch_size=3)
    for shard in ("shard-00000", "shard-00001"):
        assert (restored / f"{shard}.jsonl").read_text() == (original / f"{shard}.jsonl").read_text()
        stored, recomputed = (load_file(f / f"{shard}.features.safetensors") for f in (original, restored))
        assert stored.keys() == recomputed.keys()
        for key in stored:  # a prefill against incremental decoding: the same features up to fp16 rounding
            assert recomputed[key].shape == stored[key].shape
            torch.testing.assert_close(recomputed[key].float(), stored[key].float(), atol=2e-3, rtol=1e-2)
        stored, recomputed = (load_file(f / f"{shard}.topk.safetensors") for f in (original, restored))
        assert stored.keys() == recomputed.keys()
        for key in stored:
            if key.endswith(".probs"):
                torch.testing.assert_close(recomputed[key].float(), stored[key].float(), atol=2e-3, rtol=1e-2)
            else:
                assert torch.equal(recomputed[key], stored[key])
    # training reads it as any dataset: every record has its features and top-k
    records = load_records(restored)
    assert len(records) == len(PROMPTS) and all("features_ref" in r and "topk_ref" in r for r in records)


def test_packing_is_reproducible_and_refuses_an_unfinished_folder(tmp_path):
    target = tiny_target("llama")
    folder = written_dataset(target, tmp_path / "regen", PROMPTS)
    first = pack_dataset(folder, tmp_path / "a.tar.xz").read_bytes()
    assert pack_dataset(folder, tmp_path / "b.tar.xz").read_bytes() == first  # git sees no change
    (folder / "shard-00001.jsonl").unlink()
    with pytest.raises(InvalidArgumentError, match="unfinished .1 of 2 shards"):
        pack_dataset(folder, tmp_path / "c.tar.xz")
    assert not (tmp_path / "c.tar.xz").exists()


def test_a_restore_resumes_shard_by_shard(tmp_path):
    target = tiny_target("llama")
    archive = pack_dataset(written_dataset(target, tmp_path / "regen", PROMPTS), tmp_path / "regen.tar.xz")
    restored = restore_dataset(archive, tmp_path / "restored", target)
    kept = restored / "shard-00000.features.safetensors"
    before = kept.stat().st_mtime_ns
    (restored / "shard-00001.features.safetensors").unlink()  # as a kill mid-restore leaves it
    restore_dataset(archive, restored, target)
    assert kept.stat().st_mtime_ns == before
    assert (restored / "shard-00001.features.safetensors").exists()


def test_bad_archives_and_another_target_are_clear_errors_that_write_nothing(tmp_path):
    target = tiny_target("llama")
    archive = pack_dataset(written_dataset(target, tmp_path / "regen", PROMPTS), tmp_path / "regen.tar.xz")
    with pytest.raises(InvalidArgumentError, match="written by target"):
        restore_dataset(archive, tmp_path / "other", tiny_target("llama", layers=3))
    assert not (tmp_path / "other").exists()
    broken = tmp_path / "broken.tar.xz"
    broken.write_bytes(archive.read_bytes()[: len(archive.read_bytes()) // 2])
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        restore_dataset(broken, tmp_path / "from-broken", target)
    assert not (tmp_path / "from-broken").exists()
    with pytest.raises(InvalidArgumentError, match="no such archive"):
        restore_dataset(tmp_path / "missing.tar.xz", tmp_path / "from-missing", target)
    foreign = tmp_path / "foreign.tar.xz"
    with tarfile.open(foreign, "w:xz") as tar:
        tar.add(tmp_path / "regen" / "meta.json", arcname="../meta.json")
    with pytest.raises(InvalidArgumentError, match="not a packed dataset"):
        restore_dataset(foreign, tmp_path / "from-foreign", target)


def test_the_campaign_script_packs_and_names_a_bad_folder(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "campaign_archive.py"
    folder = written_dataset(tiny_target("llama"), tmp_path / "regen-math-9", PROMPTS)
    done = subprocess.run([sys.executable, script, "pack", folder, "--into", tmp_path / "kept"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "kept" / "regen-math-9.tar.xz").is_file()
    bad = subprocess.run([sys.executable, script, "pack", tmp_path / "nothing", "--into", tmp_path / "kept"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a finished `blockspec data` folder" in bad.stderr
    assert "Traceback" not in bad.stderr
