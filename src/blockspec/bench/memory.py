"""Peak memory of one method, measured in a process of its own (a process's peak RSS
never goes down, so methods measured in one process would hide each other).

`python -m blockspec.bench.memory '{"target": ..., "method": ..., "drafter": ..., ...}'`
prints one JSON line: the resident memory once the target and the method are loaded,
and the peak while it generates (on Linux the peak is reset after loading, so a
transient of the loading itself does not hide the generation's).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM, the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_mb() -> float:
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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

    import gc

    target = load_target(request["target"], threads=request.get("threads"))
    method = next(m for m in parse_methods(f"baseline,{request['method']}", request.get("drafter"))
                  if m.name == request["method"])
    runner = method.build(target)
    gc.collect()
    loaded = _status_mb("VmRSS") or _peak_mb()
    reset = _reset_peak()
    runner.generate(request["prompt"], max_new_tokens=request["max_new_tokens"])
    peak = _peak_mb()
    return {"method": method.name, "rss_mb_loaded": round(loaded, 1), "peak_rss_mb_generating": round(peak, 1),
            "added_mb": round(peak - loaded, 1), "peak_reset_after_load": reset}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
