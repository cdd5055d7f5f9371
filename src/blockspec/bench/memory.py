"""Peak memory of one method, measured in a process of its own (a process's peak RSS
never goes down, so methods measured in one process would hide each other).

`python -m blockspec.bench.memory '{"target": ..., "method": ..., "drafter": ..., ...}'`
prints one JSON line: the peak RSS after loading the target and after generating.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure_in_subprocess(target: str, method: str, drafter: str | None, prompt: str, max_new_tokens: int,
                          threads: int | None = None, timeout_s: float = 600) -> dict:
    request = json.dumps({"target": target, "method": method, "drafter": drafter, "prompt": prompt,
                          "max_new_tokens": max_new_tokens, "threads": threads})
    done = subprocess.run([sys.executable, "-m", "blockspec.bench.memory", request], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(request: dict) -> dict:
    from blockspec.bench.runner import parse_methods
    from blockspec.targets.loading import load_target

    target = load_target(request["target"], threads=request.get("threads"))
    loaded = _peak_mb()
    method = next(m for m in parse_methods(f"baseline,{request['method']}", request.get("drafter"))
                  if m.name == request["method"])
    runner = method.build(target)
    runner.generate(request["prompt"], max_new_tokens=request["max_new_tokens"])
    return {"method": method.name, "peak_rss_mb_after_load": round(loaded, 1), "peak_rss_mb": round(_peak_mb(), 1),
            "added_mb": round(_peak_mb() - loaded, 1)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
