"""Training data that outlives the machine it was written on.

A `blockspec data` folder is mostly the target's features (~6 KB per token); its token ids
are a few bytes. `pack_dataset` keeps only what cannot be recomputed cheaply (the config,
the prompts and the regenerated token ids) in one small reproducible `.tar.xz`, about
1 MB per 440K tokens, small enough to track in git. `restore_dataset` unpacks it and
recomputes the features and top-k distributions the folder stored with ONE prefill pass of
the target per record: regenerating the responses costs a decoding step per token, a
prefill pass costs a small fraction of that. The restored folder is a `blockspec data`
folder like any other (training reads it unchanged), and a restore resumes shard by shard.

The recomputed features come from a prefill in the precision the target is loaded in; the
stored ones came from incremental decoding in the precision that wrote the data. Both are
the target's features of the same tokens and differ only by float rounding.
"""

from __future__ import annotations

import io
import json
import lzma
import os
import tarfile
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.atomic import replace_dir, write_with
from blockspec.errors import InvalidArgumentError
from blockspec.targets.adapter import compact_features, target_features
from blockspec.training.data import (check_data_target, read_jsonl, right_padded, write_shard_features,
                                     write_shard_topk)

KEPT = ("meta.json", "prompts.jsonl")  # beside the shard-*.jsonl files


def _archived_names(folder: Path) -> list[str]:
    shards = sorted(p.name for p in folder.glob("shard-*.jsonl"))
    missing = [name for name in KEPT if not (folder / name).is_file()]
    if missing or not shards:
        raise InvalidArgumentError(f"{folder} is not a finished `blockspec data` folder "
                                   f"(no {', '.join(missing) or 'shard-*.jsonl'})")
    config = json.loads((folder / "meta.json").read_text())["config"]
    prompts = sum(1 for line in (folder / "prompts.jsonl").read_text().splitlines() if line)
    expected = -(-prompts // config["shard_size"])
    if len(shards) != expected:
        raise InvalidArgumentError(f"{folder} is unfinished ({len(shards)} of {expected} shards written): "
                                   "finish it with the same `blockspec data` command, then pack it")
    return [*KEPT, *shards]


def pack_dataset(folder: str | os.PathLike, archive: str | os.PathLike) -> Path:
    """Write `archive` (.tar.xz): the finished folder's config, prompts and token ids, no
    features. Byte-identical for the same folder (no times or owners), so git stores a
    re-pack as no change."""
    folder, archive = Path(folder), Path(archive)
    names = _archived_names(folder)
    archive.parent.mkdir(parents=True, exist_ok=True)

    def write(path: str) -> None:
        with tarfile.open(path, "w:xz", preset=9) as tar:
            for name in names:
                data = (folder / name).read_bytes()
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))

    write_with(archive, write)
    return archive


def restore_dataset(archive: str | os.PathLike, output: str | os.PathLike, target, batch_size: int = 4) -> Path:
    """Unpack `archive` into `output` (refused if another target wrote it) and recompute the
    features and top-k the dataset was written with. Resumable: shards whose files exist
    are skipped, and a folder already unpacked is not unpacked again."""
    archive, output = Path(archive), Path(output)
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
    if not (output / "prompts.jsonl").exists():
        if not archive.is_file():
            raise InvalidArgumentError(f"{archive}: no such archive")
        try:
            with tarfile.open(archive, "r:*") as tar, replace_dir(output) as staging:
                members = tar.getmembers()
                names = {m.name for m in members}
                strange = [m.name for m in members if not m.isfile() or "/" in m.name
                           or not (m.name in KEPT or (m.name.startswith("shard-") and m.name.endswith(".jsonl")))]
                if strange or not set(KEPT) <= names:
                    raise InvalidArgumentError(f"{archive} is not a packed dataset (unexpected or missing "
                                               f"members: {strange[:3] or sorted(set(KEPT) - names)})")
                # the target check reads meta.json before anything lands in `output`
                tar.extract("meta.json", staging, filter="data")
                check_data_target(staging, target)
                tar.extractall(staging, filter="data")
        except (tarfile.TarError, lzma.LZMAError, EOFError) as error:
            raise InvalidArgumentError(f"{archive} cannot be read as a packed dataset: {error}") from None
    check_data_target(output, target)
    config = json.loads((output / "meta.json").read_text())["config"]
    layers, top_k = config.get("feature_layers"), config.get("store_topk", 0)
    shards = sorted(output.glob("shard-*.jsonl"))
    todo = [s for s in shards if (layers and not s.with_suffix(".features.safetensors").exists())
            or (top_k and not s.with_suffix(".topk.safetensors").exists())]
    records_total = sum(len(read_jsonl(s)) for s in todo)
    with tqdm(total=records_total, desc=f"restoring {output.name}", unit="record") as bar:
        for shard in todo:
            records = read_jsonl(shard)
            features, top = prefill_features(target, records, layers, top_k, batch_size, bar)
            index = int(shard.stem.removeprefix("shard-"))
            if layers:  # the same files `blockspec data` writes, features first
                write_shard_features(output, index, features)
            if top_k:
                write_shard_topk(output, index, top)
    return output


@torch.inference_mode()
def prefill_features(target, records: list[dict], layers: list[int] | None, top_k: int, batch_size: int,
                     bar: tqdm | None = None) -> tuple[dict[int, torch.Tensor], dict[int, tuple]]:
    """Per record, what regeneration captured: the features of prompt + response minus its
    last token ([n - 1, layers * hidden], 16-bit) and the target's top-k (ids int32, probs
    fp16, [len(response), k]), row r the distribution response token r was chosen from."""
    features: dict[int, torch.Tensor] = {}
    top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sequences = [torch.tensor(r["prompt_ids"] + r["response_ids"][:-1]) for r in records]
    order = sorted(range(len(records)), key=lambda i: sequences[i].numel())  # little padding per batch
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids, attention = right_padded([sequences[i] for i in chunk], target.device)
        out = target.model(input_ids=ids, attention_mask=attention, output_hidden_states=bool(layers),
                           logits_to_keep=0 if top_k else 1)
        stacked = target_features(out.hidden_states, layers) if layers else None
        for row, index in enumerate(chunk):
            length = sequences[index].numel()
            if layers:
                features[index] = compact_features(stacked[row, :length].to("cpu"))
            if top_k:
                first = len(records[index]["prompt_ids"]) - 1  # the logits that chose response token 0
                chosen = torch.softmax(out.logits[row, first:length].float(), dim=-1).topk(top_k, dim=-1)
                top[index] = (chosen.indices.to("cpu", torch.int32), chosen.values.to("cpu", torch.float16))
        if bar is not None:
            bar.update(len(chunk))
    return features, top
