#!/usr/bin/env bash
# A device call returns only a few of the files under $OUT (the 2026-12-04 latency call lost 11 of its 19): pack a
# results folder into one archive beside it, keep its small summary files (args after the folder) as plain files
# next to the archive (NAME_FILE), and remove the folder.
#   bash benchmarks/pack_out.sh $OUT/vs_vllm table.md      ->  $OUT/vs_vllm.tgz, $OUT/vs_vllm_table.md
# Here: mkdir -p DEST && tar xzf vs_vllm.tgz -C DEST
set -euo pipefail
dir=${1:?usage: pack_out.sh DIR [FILE...]}
shift
parent=$(dirname "$dir") name=$(basename "$dir")
tar czf "$parent/$name.tgz" -C "$parent" "$name"
for f in "$@"; do
  [ -f "$dir/$f" ] && cp "$dir/$f" "$parent/${name}_$f"
done
rm -rf "$dir"
echo "packed: $parent/$name.tgz$(for f in "$@"; do printf ' %s' "$parent/${name}_$f"; done)"
