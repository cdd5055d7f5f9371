"""docs/training.png: held-out tau of each recipe A/B arm (runs/ab/ARM.json) and of each shipped
drafter against the CPU-hours spent to make it (points given as JSON on the command line).

    python scripts/plot_training.py docs/training.png runs/ab base anchors96 \
        --curve '[["stage 1", 0.94, 1.40, 1.2], ...]'   # [label, cpu_hours, math+code tau, chat tau]
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("output")
parser.add_argument("ab_dir")
parser.add_argument("arms", nargs="+")
parser.add_argument("--curve", default="[]", help="JSON list of [label, cpu_hours, math+code tau, chat tau]")
parser.add_argument("--left-title", default="recipe A/B at equal CPU time", help="what the left panel's bars compare")
args = parser.parse_args()

arms = {arm: json.loads((Path(args.ab_dir) / f"{arm}.json").read_text()) for arm in args.arms
        if (Path(args.ab_dir) / f"{arm}.json").exists()}
curve = json.loads(args.curve)
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
domains = ["math+code", "chat"]
width = 0.8 / max(1, len(arms))
for index, (arm, result) in enumerate(arms.items()):
    values = [result["domains"].get(d, {}).get("tau", 0.0) for d in domains]
    left.bar([i + index * width for i in range(len(domains))], values, width, label=arm)
left.set_xticks([i + width * (len(arms) - 1) / 2 for i in range(len(domains))], domains)
left.set_ylabel("held-out tau (B=16, T=0)")
left.set_ylim(1.0, None)
left.set_title(args.left_title)
left.legend(fontsize=8)
if curve:
    hours = [point[1] for point in curve]
    right.plot(hours, [point[2] for point in curve], "o-", label="math+code")
    right.plot(hours, [point[3] for point in curve], "s-", label="chat")
    for label, hour, tau, _ in curve:
        right.annotate(label, (hour, tau), textcoords="offset points", xytext=(4, 4), fontsize=8)
    right.set_xlabel("thread-hours (data + training; 2-core machine)")
    right.set_ylabel("held-out tau")
    right.set_title("shipped drafter against CPU time")
    right.legend(fontsize=8)
fig.tight_layout()
fig.savefig(args.output, dpi=100)
print(f"wrote {args.output}")
