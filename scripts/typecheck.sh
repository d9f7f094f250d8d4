#!/usr/bin/env bash
# mypy over the `shoal` package. The folders are mapped to `shoal.*` import names by
# setuptools (pyproject.toml), which mypy cannot follow, so a tree of symlinks stands in.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/shoal"
for folder in cli shared services kernels sim; do ln -s "$PWD/$folder" "$tree/shoal/$folder"; done
python=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
MYPYPATH="$tree" "$python" -m mypy --namespace-packages --explicit-package-bases -p shoal "$@"
