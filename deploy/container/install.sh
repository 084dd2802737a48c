#!/bin/sh
# The light install of kvfence (audit, gate, watch; no inference engine) into a virtual
# environment: the Containerfile's only install step, and what tests/deploy runs in a fresh
# venv, so the image and the test cannot drift apart.
#
#   install.sh [VENV [PACKAGE]]     defaults: /opt/kvfence and "kvfence" (the package
#                                   registry); PACKAGE may be a wheel, an sdist or a source tree
#
# It fails (exit 1) if the install brought torch: a gate or guard sidecar that carries an
# inference engine is the thing this recipe exists to avoid.
set -eu

venv="${1:-/opt/kvfence}"
package="${2:-kvfence}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
# No extras: `kvfence[serve]` is the engine. No cache: nothing of pip's is kept in the image.
"$venv/bin/pip" install --no-cache-dir --disable-pip-version-check --quiet "$package"

if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "install.sh: torch came with '$package': this is not the light install" >&2
    exit 1
fi
"$venv/bin/kvfence" --version
