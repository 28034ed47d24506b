#!/usr/bin/env bash
# Create (idempotently) the side venv that holds Zeus 0.16.0 for benchmarking.
#
# Why a separate venv: Zeus pins versions (numpy<2, pydantic, sqlalchemy, ...)
# that conflict with the bso package's own dependencies, so it is kept out of
# .venv and only reached through scripts/zeus_driver.py as a subprocess.
#
# Usage: scripts/setup_zeus_venv.sh   (prints the venv's python path at the end)
# Env:   ZEUS_VENV overrides the location (default: <repo>/.venv-zeus)
#        PYTHON    overrides the interpreter used to create it (default: python3)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZEUS_VENV:-$repo_root/.venv-zeus}"
python="${PYTHON:-python3}"

# The exact package set; the marker file records it so that a changed set
# triggers a reinstall while an unchanged one is a no-op.
packages=("zeus[bso-server]==0.16.0" "aiosqlite" "greenlet" "numpy<2")
marker="$venv/.bso-zeus-packages"
wanted="${packages[*]}"

# Cheap sanity check of an existing venv: package metadata only, because
# importing zeus pulls in scikit-learn and takes seconds.
check='import importlib.metadata as m, sys
v = {d: m.version(d) for d in ("zeus", "aiosqlite", "greenlet", "numpy", "sqlalchemy", "fastapi")}
sys.exit(v["zeus"] != "0.16.0" or int(v["numpy"].split(".")[0]) >= 2)'

if [[ -x "$venv/bin/python" && -f "$marker" && "$(cat "$marker")" == "$wanted" ]] \
  && "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "zeus venv already set up: $venv" >&2
else
  echo "installing zeus into venv: $venv" >&2
  if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install --quiet "${packages[@]}" >&2
  "$venv/bin/python" -c "import zeus.optimizer.batch_size.server.optimizer, aiosqlite"
  printf '%s' "$wanted" >"$marker"
fi

echo "$venv/bin/python"
