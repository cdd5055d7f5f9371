#!/usr/bin/env bash
# Prepare the GPU shot (issue 13; run here, on the CPU machine, once): what the device machine
# lacks goes into .gpu/ (ignored by git, listed in .git/info/exclude), cut to fit the device
# tool's 64 MiB per call beside the ~28 MB working tree:
#   .gpu/part-1 .. part-3   the default target's GGUF (98 MB) in three pieces, + its sha256
#   .gpu/wheels/            transformers 5.24 (the device has 5.17), gguf, platformdirs
#   .gpu/gsm8k-train.jsonl  the training prompts (../shared does not travel)
# Then four back-to-back calls (a warm machine keeps ignored paths between them):
#   run(command="true", carry=[".gpu/part-1"])
#   run(command="true", carry=[".gpu/part-2"])
#   run(command="true", carry=[".gpu/part-3"])
#   run(command="bash scripts/gpu_drafter.sh", carry=[".gpu/wheels", ".gpu/gsm8k-train.jsonl", ".gpu/gguf.sha256"],
#       timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
GGUF=$(.venv/bin/python -c "from blockspec.targets.loading import default_gguf_path; print(default_gguf_path())")
grep -qx "/.gpu/" .git/info/exclude || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/wheels
split -n 3 -d -a 1 "$GGUF" .gpu/part-tmp-
for i in 0 1 2; do mkdir -p ".gpu/part-$((i + 1))"; mv ".gpu/part-tmp-$i" ".gpu/part-$((i + 1))/piece"; done
(sha256sum "$GGUF" | cut -d' ' -f1) > .gpu/gguf.sha256
cp "$DATA/gsm8k/train.jsonl" .gpu/gsm8k-train.jsonl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels transformers==5.24.0 gguf==0.19.0 platformdirs==4.14.9
du -sh .gpu/* | sed 's/^/  /'
