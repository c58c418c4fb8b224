#!/usr/bin/env bash
# Install libreyolo-agent and its training stack into a virtual environment.
#
#   ./install.sh            agent + training stack (torch first, then libreyolo, then the agent)
#   ./install.sh --dev      the same plus the test and lint tools
#
# Environment:
#   VENV          where the environment goes                 (default: .venv beside this script)
#   PYTHON        the interpreter to build it from           (default: python3.11, else python3)
#   TORCH_SPEC    the torch build that fits THIS machine's card; installed first so that pip
#                 does not pick one by itself. Default: "torch==2.14.1 torchvision==0.29.1".
#                 On a GPU box pass the build for its CUDA, e.g. with --index-url in PIP_ARGS.
#   PIP_ARGS      extra arguments for every pip call
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VENV:-$here/.venv}"
torch_spec="${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"
extras="train"
for arg in "$@"; do
  case "$arg" in
    --dev) extras="train,dev" ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

python="${PYTHON:-}"
if [ -z "$python" ]; then
  python="$(command -v python3.11 || command -v python3 || true)"
fi
if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  step "creating the virtual environment in $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check ${PIP_ARGS:-})

step "installing torch first: $torch_spec"
# shellcheck disable=SC2086
"${pip[@]}" install $torch_spec

step "installing libreyolo-agent with extras [$extras]"
"${pip[@]}" install -e "$here[$extras]"

step "checking the install"
"$venv/bin/libreyolo-agent" --version
"$venv/bin/python" -c 'import libreyolo, torch; print("libreyolo", libreyolo.__version__, "/ torch", torch.__version__)'
echo
echo "done: $venv/bin/libreyolo-agent run    (runs the demo job)"
