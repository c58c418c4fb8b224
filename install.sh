#!/usr/bin/env bash
# Install libreyolo-agent and its training stack into a virtual environment.
#
#   ./install.sh            agent + training stack (torch first, then libreyolo, then the agent)
#   ./install.sh --dev      the same plus the test and lint tools
#   ./install.sh --dry-run  print the steps and pip commands without running them
#
# On a box with nvidia-smi the `gpu` extra (nvidia-ml-py, for the driver checks) is added.
# Running it again is safe: pip leaves what is already installed as it is.
#
# Environment:
#   VENV          where the environment goes                 (default: .venv beside this script)
#   PYTHON        the interpreter to build it from           (default: python3.11, else python3)
#   TORCH_SPEC    the torch build that fits THIS machine's card; installed first so that pip
#                 does not pick one by itself. Default: "torch==2.14.1 torchvision==0.29.1".
#   PIP_ARGS      extra pip arguments for the torch install ONLY, e.g. the CUDA wheel index:
#                 PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128". libreyolo and
#                 the agent always come from the usual index (a torch-only index lacks them).
#                 Settings for every pip call go in pip's own variables (PIP_PROXY, ...).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VENV:-$here/.venv}"
torch_spec="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"
extras="train"
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="train,dev" ;;
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done
gpu_note=""
if command -v nvidia-smi >/dev/null 2>&1; then
  extras="$extras,gpu"
  gpu_note=" (gpu: nvidia-smi is here)"
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
  python="$(command -v python3.11 || command -v python3 || true)"
fi
if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

step() { printf '\n==> %s\n' "$*"; }
# run CMD...: run it, or with --dry-run only show it.
run() {
  if [ "$dry_run" = 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

if [ ! -x "$venv/bin/python" ]; then
  step "creating the virtual environment in $venv"
  run "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# TORCH_SPEC and PIP_ARGS each hold several words (read splits them, without globbing).
read -r -a torch_args <<<"$torch_spec"
read -r -a torch_pip_args <<<"${PIP_ARGS:-}"

step "installing torch first: $torch_spec${PIP_ARGS:+ (with $PIP_ARGS)}"
run "${pip[@]}" install ${torch_pip_args[@]+"${torch_pip_args[@]}"} "${torch_args[@]}"

step "installing libreyolo-agent with extras [$extras]$gpu_note"
# No PIP_ARGS here: a CUDA wheel index holds torch, not libreyolo or the agent's dependencies.
run "${pip[@]}" install -e "$here[$extras]"

step "checking the install"
run "$venv/bin/libreyolo-agent" --version
run "$venv/bin/python" -c 'import libreyolo, torch; print("libreyolo", libreyolo.__version__, "/ torch", torch.__version__)'
echo
if [ "$dry_run" = 1 ]; then
  echo "dry run: nothing was installed"
else
  echo "done: $venv/bin/libreyolo-agent run    (runs the demo job)"
fi
