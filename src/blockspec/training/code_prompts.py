"""HumanEval-style code prompts mined from Python source files on this machine.

HumanEval asks the model to complete a function from its signature and docstring; the
project's own coding prompts are written requests ("Write a Python function that ..."),
so the drafter never saw the signature form. Any Python tree that is installed holds
thousands of such functions, reachable without a hub: `python-functions:stdlib` (the
running interpreter's standard library) or `python-functions:DIR`. A prompt is a public
top-level function's `def` line and docstring, its body and decorators dropped, exactly
what a HumanEval prompt holds. The order is a fixed shuffle across modules, so slices
(`python-functions:stdlib[0:400]`, `[400:800]`) are disjoint samples of every module.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

from blockspec.errors import InvalidArgumentError

SOURCE_PREFIX = "python-functions:"
# test suites and GUI demos read nothing like library functions; installed packages are
# left to an explicit DIR so that `stdlib` means the same prompts on every machine
_SKIPPED_FOLDERS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"}
_DOCSTRING_CHARS = (40, 800)  # one-liners say too little to write a body from; long ones are manuals


def python_function_prompts(location: str, seed: int = 0) -> list[str]:
    """Signature + docstring prompts of every public top-level function under `location`."""
    root = Path(sysconfig.get_paths()["stdlib"]) if location == "stdlib" else Path(location).expanduser()
    if not root.is_dir():
        raise InvalidArgumentError(f"{SOURCE_PREFIX}{location}: not a folder (use 'stdlib' or a folder of .py files)")
    prompts: dict[str, None] = {}  # ordered and deduplicated (some modules are copied around)
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_FOLDERS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            module = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # a file this Python cannot parse is simply not a source of prompts
        for node in module.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            docstring = ast.get_docstring(node)
            if docstring is None or not _DOCSTRING_CHARS[0] <= len(docstring) <= _DOCSTRING_CHARS[1]:
                continue
            node.body, node.decorator_list = node.body[:1], []  # the docstring expression only
            prompts[ast.unparse(node) + "\n"] = None
    if not prompts:
        raise InvalidArgumentError(f"{SOURCE_PREFIX}{location}: no public function with a docstring found")
    ordered = list(prompts)
    random.Random(seed).shuffle(ordered)
    return ordered
