#!/usr/bin/env bash
# Install libreyolo-agent and its training stack into a virtual environment.
#
#   ./install.sh                 agent + training stack (torch first, then libreyolo and the agent)
#   ./install.sh --dev           the same plus the test and lint tools
#   ./install.sh --job JOB.toml  also the extras that job needs: LibreYOLO's (rfdetr, eomt, lora,
#                                onnx) and its [train] loggers' clients (tensorboard, mlflow, wandb)
#   ./install.sh --extras LIST   also these LibreYOLO extras (comma-separated)
#   ./install.sh --dry-run       print the decisions and pip commands without running them
#
# torch: on a box with nvidia-smi the driver and the cards decide (one nvidia-smi call; torch is
# read from its files, never imported). The image's torch is kept when it runs on that driver and
# has kernels for every card (no 2 GB download): the venv gets a .pth naming the image's
# site-packages (after its own) and is checked to import exactly that torch before going on.
# Otherwise the newest PyTorch CUDA build the driver runs is installed, before libreyolo, so pip
# never picks a torch by itself. Without nvidia-smi: PyTorch's CPU wheels where its CPU index
# answers (5 s at most), else the default build. The choice and its reason are printed
# (agent/install/torchpick.py holds the tables). Running it again changes nothing, and runs no pip when
# the venv's stamp (.libreyolo-agent-install: what the last complete install was made from)
# still matches. The agent's build backend is in this tree (buildsys/, standard library only):
# its isolated build installs nothing first.
#
# Environment:
#   VENV              where the environment goes               (default: .venv beside this script)
#   PYTHON            the interpreter to build it from         (default: python3.11, else python3)
#   TORCH_SPEC        a torch build of your choosing instead ("torch==X torchvision==Y")
#   PIP_ARGS          extra pip arguments for the torch install ONLY, e.g. a CUDA wheel index
#                     ("--index-url <index>/cu128"); with either of these two set, no decision
#                     is made. libreyolo and the agent always come from the usual index.
#                     Settings for every pip call go in pip's own variables (PIP_PROXY, ...).
#   LIBREYOLO_EXTRAS  LibreYOLO extras to add, like --extras
#   TORCH_INDEX_BASE  where PyTorch's per-CUDA and CPU wheel indexes live (a mirror)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${VENV:-$here/.venv}"
default_torch_spec="torch==2.14.1 torchvision==0.29.1"
agent_extras="train"
also="${LIBREYOLO_EXTRAS:-}"
job=""
dry_run=0

usage() { sed -n '2,/^set -euo/p' "$0" | sed -n 's/^# \{0,1\}//p'; }
die() { printf 'install.sh: %s\n' "$1" >&2; exit "${2:-1}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dev) agent_extras="train,dev" ;;
    --dry-run) dry_run=1 ;;
    --job) [ $# -ge 2 ] || die "--job needs a file" 2; job="$2"; shift ;;
    --job=*) job="${1#--job=}" ;;
    --extras) [ $# -ge 2 ] || die "--extras needs a list" 2; also="$also,$2"; shift ;;
    --extras=*) also="$also,${1#--extras=}" ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" 2 ;;
  esac
  shift
done
if [ -n "$job" ] && [ ! -r "$job" ]; then
  die "cannot read the job file '$job'" 2
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
  python="$(command -v python3.11 || command -v python3 || true)"
fi
if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  die "Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)"
fi

step() { printf '\n==> %s\n' "$*"; }
# now: microseconds since the epoch (bash 5's clock; date's where older).
now() { if [ -n "${EPOCHREALTIME:-}" ]; then printf '%s' "${EPOCHREALTIME/./}"; else date +%s%6N; fi; }
# secs FROM TO: the seconds between two of now's readings, to the hundredth.
secs() { local d=$(($2 - $1)); printf '%d.%02d' $((d / 1000000)) $((d % 1000000 / 10000)); }
t_start="$(now)"
# run CMD...: run it, or with --dry-run only show it.
run() {
  if [ "$dry_run" = 1 ]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}
# torchpick ARGS...: agent/install/torchpick.py from this source tree (standard library only).
torchpick() { PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" -m agent.install.torchpick "$@"; }

# ---- which torch: decided before the venv exists (it decides how the venv is made)
image_pth="_libreyolo_image_torch.pth"  # agent/install/torchpick.py's IMAGE_PTH
# venv_site: the venv's own site-packages (where pip installs, and the .pth goes).
venv_site() { "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
pth_dirs=""
kept=""
if [ -n "${TORCH_SPEC:-}" ] || [ -n "${PIP_ARGS:-}" ]; then
  action="install"
  torch_spec="${TORCH_SPEC:-$default_torch_spec}"
  torch_pip="${PIP_ARGS:-}"
  reason="TORCH_SPEC/PIP_ARGS are set: used as given"
else
  no_keep=()
  if [ -x "$venv/bin/python" ] && [ -r "$venv/pyvenv.cfg" ] \
      && [[ "$(<"$venv/pyvenv.cfg")" != *"include-system-site-packages = true"* ]] \
      && ! compgen -G "$venv/lib/python*/site-packages/$image_pth" >/dev/null; then
    no_keep=(--no-keep)  # this venv was made without the image's packages: it installs its own
  fi
  pick="$(torchpick torch --lines --python "$python" ${no_keep[@]+"${no_keep[@]}"})"
  mapfile -t decision <<<"$pick"
  action="${decision[0]}"
  torch_spec="${decision[1]}"
  torch_pip="${decision[2]}"
  pth_dirs="${decision[3]}"
  kept="${decision[4]}"
  reason="${decision[5]}"
fi
t_decided="$(now)"
case "$action" in
  keep) step "torch: keeping the image's torch - $reason" ;;
  install) step "torch: installing $torch_spec${torch_pip:+ ($torch_pip)} - $reason" ;;
  *) step "torch: the default build $torch_spec - $reason" ;;
esac

# ---- LibreYOLO's extras the job asks for
lib_extras=""
if [ -n "$job" ] || [ -n "${also//,/}" ]; then
  job_args=()
  [ -z "$job" ] || job_args=("$job")
  picked="$(torchpick extras ${job_args[@]+"${job_args[@]}"} --also "$also")" || exit 2
  mapfile -t extras_lines <<<"$picked"
  lib_extras="${extras_lines[0]}"
  if [ -n "$lib_extras" ]; then
    step "libreyolo extras: $lib_extras"
    printf '    %s\n' "${extras_lines[@]:1}"
  fi
fi
# ---- the agent's extras the job asks for: the clients of its [train] loggers
if [ -n "$job" ]; then
  picked="$(torchpick agent-extras "$job")" || exit 2
  mapfile -t extras_lines <<<"$picked"
  if [ -n "${extras_lines[0]}" ]; then
    agent_extras="$agent_extras,${extras_lines[0]}"
    step "agent extras (the loggers' clients): ${extras_lines[0]}"
    printf '    %s\n' "${extras_lines[@]:1}"
  fi
fi

# ---- the environment
t_venv="$(now)"
# image_pip: the image's site-packages folder whose pip the new venv runs, seen through the .pth
# below, instead of a pip of its own: `python -m venv` spends about 3 s installing pip (ensurepip
# installs and compiles its ~800 files) on a box billed by the second. Only a pip new enough for
# every option used here (23.0: --dry-run --report) is taken.
image_pip=""
if [ "$action" = keep ]; then
  IFS=: read -r -a dirs <<<"$pth_dirs"
  for dir in "${dirs[@]}"; do
    if [ -r "$dir/pip/__init__.py" ] \
        && [[ "$(<"$dir/pip/__init__.py")" =~ __version__\ *=\ *[\"\']([0-9]+)\. ]] \
        && [ "${BASH_REMATCH[1]}" -ge 23 ]; then
      image_pip="$dir"
      break
    fi
  done
fi
if [ ! -x "$venv/bin/python" ]; then
  if [ -n "$image_pip" ]; then
    step "creating the virtual environment in $venv (no pip of its own: the image's, in $image_pip, installs into it)"
    run "$python" -m venv --without-pip "$venv"
  else
    step "creating the virtual environment in $venv"
    run "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# pip installs without compiling (it compiles one file after another: libreyolo's ~1,200 alone
# took about 2 s of a 3 s install); compile() below does it on every core once pip is done.
install=(install --no-compile)
installed=0
compile() {
  if [ "$dry_run" = 1 ]; then
    printf '+ %q -m compileall -qq -j0 <venv site-packages> %q\n' "$venv/bin/python" "$here/agent"
  else
    # pip ignores a file that does not compile (a package's test data): so does this.
    "$venv/bin/python" -m compileall -qq -j0 "$(venv_site)" "$here/agent" || true
  fi
}
# sees_torch [--expect DIR]...: which torch the venv imports, from its files (no import).
sees_torch() { torchpick sees --python "$venv/bin/python" "$@"; }
expect=()
if [ "$action" = keep ]; then
  # `python -m venv` builds on the base interpreter: when the image's python3 is itself a venv
  # (uv-made GPU images), --system-site-packages would show the base's packages, not the torch
  # just read. A .pth in the venv's site-packages names the image's own site-packages instead;
  # site appends its folders after the venv's, so whatever pip installs here wins over the image.
  IFS=: read -r -a dirs <<<"$pth_dirs"
  IFS=: read -r -a packages <<<"$kept"
  for package in "${packages[@]}"; do expect+=(--expect "$package"); done
  step "making the venv see the image's torch: $image_pth naming ${dirs[*]}"
  if [ "$dry_run" = 1 ]; then
    printf '+ write <venv site-packages>/%s: %s\n' "$image_pth" "${dirs[*]}"
    printf '+ check the venv imports the torch in %s\n' "${packages[*]}"
  else
    pth="$(venv_site)/$image_pth"
    want="$(printf '%s\n' "${dirs[@]}")"
    if [ ! -f "$pth" ] || [ "$(<"$pth")" != "$want" ]; then
      printf '%s\n' "$want" >"$pth"
    fi
    if ! seen="$(sees_torch "${expect[@]}")"; then
      die "the venv does not import the image's torch (${packages[*]}); nothing was installed.
  Remove $venv and run this again, or install a torch of your choosing instead: TORCH_SPEC=\"$default_torch_spec\" $0"
    fi
    echo "the venv sees $seen"
  fi
elif [ "$dry_run" = 0 ] && [ -x "$venv/bin/python" ]; then
  pth="$(venv_site)/$image_pth"
  if [ -f "$pth" ]; then
    step "the image's torch is not kept: removing $pth (the venv installs its own packages)"
    rm -f "$pth"
  fi
fi
# own_pip_now WHY: the venv's own pip, from ensurepip (offline: its bundled wheel), in place of
# bin/pip and bin/pip3 written below to run the image's.
own_pip_now() {
  step "$1"
  rm -f "$venv/bin/pip" "$venv/bin/pip3"
  "$venv/bin/python" -m ensurepip --default-pip
}
# The venv runs pip: its own, or the image's through the .pth (then bin/pip runs that one too, as
# pip's own command would); a venv made without one whose .pth is gone gets its own now.
if [ "$dry_run" = 0 ] && [ -x "$venv/bin/python" ]; then
  site="$(venv_site)"
  if [ -r "$site/pip/__init__.py" ]; then
    :
  elif [ -n "$image_pip" ] && [ -f "$site/$image_pth" ]; then
    for name in pip pip3; do
      if [ ! -e "$venv/bin/$name" ]; then
        printf '#!%s\nimport sys\n\nfrom pip._internal.cli.main import main\n\nsys.exit(main())\n' \
          "$venv/bin/python" >"$venv/bin/$name"
        chmod 755 "$venv/bin/$name"
      fi
    done
  else
    own_pip_now "installing pip into the venv (it has none of its own, and sees none)"
  fi
fi

# own_pip: after a failed pip run, when the pip that failed was the image's (borrowed above) and
# it cannot even start in this venv (a damaged or patched pip), give the venv its own so pip can
# run again. False otherwise: the failure was pip's answer to the install, and stands.
own_pip() {
  [ "$dry_run" = 0 ] && [ -n "$image_pip" ] && [ ! -r "$(venv_site)/pip/__init__.py" ] || return 1
  if "$venv/bin/python" -c 'from pip._internal.cli.main import main' >/dev/null 2>&1; then
    return 1
  fi
  own_pip_now "the image's pip (in $image_pip) does not start in this venv: installing the venv's own pip"
}

t_pip="$(now)"
targets=(-e "${here}[$agent_extras]")
[ -z "$lib_extras" ] || targets+=("libreyolo[$lib_extras]")

# The stamp: what the last complete install was made from (this script, pyproject.toml, the
# extras, the torch decision, the venv's Python and the packages in its site-packages). When it
# matches, nothing can have changed and pip is not run at all (a second boot); any change, or
# none recorded, takes the full path, and the stamp is written again only once the check passed.
stamp_file="$venv/.libreyolo-agent-install"
stamp() {
  {
    sha256sum "$here/install.sh" "$here/pyproject.toml" | cut -d' ' -f1
    printf '%s\n' "$here" "$agent_extras" "$lib_extras" "$action" "$torch_spec" "$torch_pip" \
      "$pth_dirs" "$kept" "$reason" "$(readlink -f "$venv/bin/python")"
    # The venv's own distributions and .pth files, by name (pip install/uninstall changes them).
    for found in "$venv"/lib/python*/site-packages/*.dist-info "$venv"/lib/python*/site-packages/*.pth; do
      if [ -e "$found" ]; then printf '%s\n' "${found##*/}"; fi
    done
  } | sha256sum | cut -d' ' -f1
}
recorded=0
if [ "$dry_run" = 0 ] && [ -r "$stamp_file" ] && [ "$(<"$stamp_file")" = "$(stamp)" ]; then
  recorded=1
elif [ "$dry_run" = 0 ]; then
  rm -f "$stamp_file"
fi

if [ "$recorded" = 1 ]; then
  step "installing libreyolo-agent with extras [$agent_extras]${lib_extras:+ and libreyolo[$lib_extras]}"
  echo "already installed, nothing to change (as recorded in $stamp_file)"
else
  if [ "$action" != keep ]; then
    # TORCH_SPEC and PIP_ARGS each hold several words (read splits them, without globbing).
    read -r -a torch_args <<<"$torch_spec"
    read -r -a torch_pip_args <<<"$torch_pip"
    step "installing torch first: $torch_spec${torch_pip:+ (with $torch_pip)}"
    run "${pip[@]}" "${install[@]}" ${torch_pip_args[@]+"${torch_pip_args[@]}"} "${torch_args[@]}"
    installed=1
  fi

  # up_to_date: pip has nothing left to do but reinstall the editable agent, already installed
  # from here (pip lists an editable install every time; reinstalling it would change the venv).
  up_to_date() {
    [ "$dry_run" = 0 ] && [ -x "$venv/bin/python" ] || return 1
    local site report status=1
    site="$(venv_site)"
    compgen -G "$site/libreyolo_agent-*.dist-info" >/dev/null || return 1
    report="$(mktemp)"
    if "${pip[@]}" install --quiet --dry-run --report "$report" \
        "${targets[@]}" \
        && torchpick uptodate "$report" --project "$here" --site "$site"; then
      status=0
    fi
    rm -f "$report"
    return "$status"
  }

  step "installing libreyolo-agent with extras [$agent_extras]${lib_extras:+ and libreyolo[$lib_extras]}"
  if up_to_date; then
    echo "already installed, nothing to change"
  else
    # No PIP_ARGS here: a CUDA wheel index holds torch, not libreyolo or the agent's dependencies.
    if ! run "${pip[@]}" "${install[@]}" "${targets[@]}"; then
      own_pip || die "pip could not install libreyolo-agent into $venv (its output is above)"
      run "${pip[@]}" "${install[@]}" "${targets[@]}"
    fi
    installed=1
  fi
  if [ "$installed" = 1 ]; then
    step "compiling what pip installed (every core)"
    compile
  fi
fi

# The libreyolo command: where the image's site-packages (seen through the .pth) already hold the
# libreyolo the agent needs, pip installs nothing and writes no command into the venv, and the
# agent (which starts the trainer through the libreyolo beside its own Python) would find none,
# or another Python's on PATH. It is written here, running this venv's Python.
if [ "$dry_run" = 0 ] && [ ! -e "$venv/bin/libreyolo" ] && [[ ",$agent_extras," == *,train,* ]] \
    && "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("libreyolo") is None)' 2>/dev/null; then
  printf '#!%s\nimport sys\n\nfrom libreyolo.cli import entrypoint\n\nsys.exit(entrypoint())\n' \
    "$venv/bin/python" >"$venv/bin/libreyolo"
  chmod 755 "$venv/bin/libreyolo"
  echo "wrote $venv/bin/libreyolo: the image's libreyolo, run by this venv's Python"
fi

t_check="$(now)"
step "checking the install"
run "$venv/bin/libreyolo-agent" --version
# From the packages' files, no torch import: the agent's preflight imports torch in its probe
# anyway (overlapped with staging), a few seconds later.
if [ "$dry_run" = 1 ]; then
  printf '+ torchpick sees --python %q%s\n' "$venv/bin/python" "${expect[*]:+ ${expect[*]}}"
elif ! seen="$(sees_torch ${expect[@]+"${expect[@]}"})"; then
  die "the install is incomplete (above: what the venv lacks); run ./install.sh again"
else
  echo "$seen"
  if [ "$recorded" = 0 ]; then
    stamp >"$stamp_file"
  fi
fi
echo
# One line for people and for bench/firstbox.py: where this run's time went.
printf 'install.sh: timing: torch decision %s s, venv %s s, pip %s s, check %s s, total %s s\n' \
  "$(secs "$t_start" "$t_decided")" "$(secs "$t_venv" "$t_pip")" "$(secs "$t_pip" "$t_check")" \
  "$(secs "$t_check" "$(now)")" "$(secs "$t_start" "$(now)")"
if [ "$dry_run" = 1 ]; then
  echo "dry run: nothing was installed"
else
  echo "done: $venv/bin/libreyolo-agent run    (runs the demo job)"
fi
