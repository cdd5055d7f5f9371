"""Keep the campaign's regenerated data across machines: pack finished `blockspec data` folders
to their token ids (tracked in git, `data/campaign/`), restore them on a new machine with one
prefill pass of the target that recomputes their features and top-k (blockspec.training.archive).

    python scripts/campaign_archive.py pack runs/campaign/regen-math-28 [...]   # -> data/campaign/NAME.tar.xz
    python scripts/campaign_archive.py restore --threads 1                     # every archive not yet restored
    python scripts/campaign_archive.py restore --dtype bfloat16                # faster on CPUs with AMX
    python scripts/campaign_archive.py restore data/campaign/regen-math-28.tar.xz

`runs/` has been lost with its machine eight times in 35 sessions, and with it every round's data:
a round then had to be written and trained on inside one session. Restored, rounds accumulate.
A restore resumes shard by shard after a kill (rerun the same command).
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = ".tar.xz"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
commands = parser.add_subparsers(dest="command", required=True)
pack = commands.add_parser("pack", help="pack finished data folders")
pack.add_argument("folders", nargs="+", type=Path)
pack.add_argument("--into", type=Path, default=ROOT / "data" / "campaign", help="archive folder (data/campaign)")
restore = commands.add_parser("restore", help="restore archives into data folders")
restore.add_argument("archives", nargs="*", type=Path, help="default: every archive in data/campaign")
restore.add_argument("--into", type=Path, default=ROOT / "runs" / "campaign", help="parent of the folders (runs/campaign)")
restore.add_argument("--target", default="default")
restore.add_argument("--threads", type=int, default=1)
restore.add_argument("--batch-size", type=int, default=4, help="records per prefill pass")
restore.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                     help="the target's precision for the prefill: bfloat16 on CPUs with AMX (as data is written there)")
args = parser.parse_args()

from blockspec.errors import BlockspecError  # noqa: E402  (after argparse: --help stays fast)
from blockspec.training.archive import pack_dataset, restore_dataset  # noqa: E402

try:
    if args.command == "pack":
        for folder in args.folders:
            archive = pack_dataset(folder, args.into / f"{folder.name}{SUFFIX}")
            print(f"{folder} -> {archive} ({archive.stat().st_size / 1e6:.2f} MB)")
    else:
        archives = args.archives or sorted((ROOT / "data" / "campaign").glob(f"*{SUFFIX}"))
        if not archives:
            parser.error("no archives given and none in data/campaign")
        from blockspec.targets.loading import load_target

        target = load_target(args.target, threads=args.threads, dtype=args.dtype)
        started = time.perf_counter()
        for archive in archives:
            folder = restore_dataset(archive, args.into / archive.name.removesuffix(SUFFIX), target, args.batch_size)
            print(f"{archive} -> {folder}")
        print(f"restored {len(archives)} data folders in {time.perf_counter() - started:.0f} s")
except BlockspecError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
