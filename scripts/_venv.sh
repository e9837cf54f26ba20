# Sourced by the scripts in this folder: create or reuse .venv and install the project into it.
#
# Torch is installed first (`pip install torch==2.13.0`), so no other requirement pulls a newer
# multi-GB build.
# GPU or Ascend users: install the torch build for your accelerator into .venv
# first (e.g. `.venv/bin/pip install torch==2.13.0 --index-url <your CUDA wheel index>`,
# or torch + torch_npu from the Ascend instructions); an installed torch is kept.
# Set TORCH_SPEC to choose the requirement used when torch is missing, and TORCH_INDEX_URL to take it
# from another index: plain PyPI serves Linux x86_64 torch with CUDA libraries; where
# download.pytorch.org is reachable, TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives the
# CPU-only build.

set -euo pipefail
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

install_project() {
    local extras="${1:-}"
    if ! python -c "import torch" >/dev/null 2>&1; then
        echo "==> installing ${TORCH_SPEC:-torch==2.13.0}${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
        python -m pip install -q --disable-pip-version-check ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
            "${TORCH_SPEC:-torch==2.13.0}"
    fi
    local stamp="$VENV/.installed${extras:+-$extras}"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "==> installing qwen3-pretrain${extras:+[$extras]}"
        python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
        touch "$stamp"
    fi
}
