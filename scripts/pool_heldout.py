"""Pool `blockspec eval-drafter` results of one drafter on several held-out subsets (--seed).

    python scripts/pool_heldout.py runs/ab/ARM.json runs/ab/ARM.seed2.json [...]

Eight prompts per dataset leave tau noisy: on MT-Bench two subsets of eight gave the same drafter
1.70 and 1.93 (docs/training.md, session 32). Each result's tau is committed tokens per step
over its prompts, so the pooled tau weighs each subset by its steps, as one run over all of
them would (position-1 rates likewise). A prompt drawn by two subsets counts twice.
"""
import argparse
import json
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("results", nargs="+", help="eval-drafter --output files of ONE drafter")
parser.add_argument("--json", action="store_true", help="print the pooled result as JSON")
args = parser.parse_args()

try:
    results = [json.loads(open(path).read()) for path in args.results]
except (OSError, json.JSONDecodeError) as error:
    parser.error(f"cannot read a result: {error}")
drafters = {r.get("drafter") for r in results}
if len(drafters) > 1:
    parser.error(f"results of different drafters: {sorted(map(str, drafters))}")
seeds = [r.get("subset_seed") for r in results]
if len(set(seeds)) < len(seeds):
    parser.error(f"the same subset twice (seeds {seeds})")
settings = {(r["block_size"], r["tree_budget"], r["max_new_tokens"]) for r in results}
if len(settings) > 1:
    parser.error(f"results measured with different settings (block size, tree budget, new tokens): {settings}")


def pool(rows: list[dict]) -> dict:
    steps = sum(r["steps"] for r in rows)
    return {"tau": round(sum(r["tau"] * r["steps"] for r in rows) / steps, 4),
            "pos1": round(sum(r["pos1"] * r["steps"] for r in rows) / steps, 4), "steps": steps}


pooled = {}
for level in ("datasets", "domains"):
    names = [name for name in results[0][level] if all(name in r[level] for r in results)]
    pooled[level] = {name: pool([r[level][name] for r in results]) for name in names}
pooled.update(subset_seeds=seeds, prompts_per_dataset=sum(r["prompts_per_dataset"] for r in results),
              drafter=drafters.pop())
if args.json:
    json.dump(pooled, sys.stdout, indent=2)
    print()
else:
    for name, row in {**pooled["datasets"], **pooled["domains"]}.items():
        print(f"{name:>10}: tau {row['tau']:.3f}  pos-1 {row['pos1']:.3f}  ({row['steps']} steps)")
