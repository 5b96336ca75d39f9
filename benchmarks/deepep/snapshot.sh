#!/usr/bin/env bash
# DeepEP's public source at v1.2.1 (the last V1 release) into an ignored folder, from a clone or mirror of
# https://github.com/deepseek-ai/DeepEP. The project never commits it; `run` carries the folder to the GPU machine.
#
#   bash benchmarks/deepep/snapshot.sh PATH_TO_DEEPEP_GIT [DEST=third_party/DeepEP]
set -euo pipefail
repo=${1:?usage: snapshot.sh PATH_TO_DEEPEP_GIT [DEST]}
dest=${2:-third_party/DeepEP}
rev=v1.2.1
rm -rf "$dest" && mkdir -p "$dest"
git -C "$repo" archive "$rev" | tar -x -C "$dest"
git -C "$repo" rev-parse "$rev^{commit}" > "$dest/SNAPSHOT_COMMIT"
echo "DeepEP $rev ($(cat "$dest/SNAPSHOT_COMMIT")) in $dest: $(du -sh "$dest" | cut -f1)"
