#!/usr/bin/env bash
# The on-start entry of a rented GPU box: install, fetch the job, start the agent supervised.
# Paste ONE line into Vast's on-start script, RunPod's start command or cloud-init, with
# LIBREYOLO_AGENT_REPO set to this repository's git URL (your fork or the project's):
#
#   R=/opt/libreyolo-agent; [ -d "$R/.git" ] || { rm -rf "$R.part" && git clone "$LIBREYOLO_AGENT_REPO" "$R.part" && mv "$R.part" "$R"; } && "$R/scripts/bootstrap.sh"
#
# It is safe at every start (the on-start hooks of Vast and RunPod run at every boot): the clone
# goes to $R.part and becomes $R only once complete, so an interrupted clone is started over and
# an existing one is kept as it is (update it yourself: git -C /opt/libreyolo-agent pull, then run
# this script again); a second run of this script changes nothing and never starts a second
# agent; a supervisor that died is started again.
#
# Usage: bootstrap.sh [--job PATH | --job hf://[datasets/]org/repo[@rev]/path/job.toml]
#                     [--no-install] [-h|--help]
#   --no-install  use the virtual environment as it is (do not run install.sh)
#
# The job, first found wins:
#   --job                    a file, or a file in a Hub repo (fetched with HF_TOKEN)
#   LIBREYOLO_AGENT_JOB_TOML the job's TOML text itself (providers set variables, not files)
#   LIBREYOLO_AGENT_JOB      a file path or an hf:// URL, as --job
#   the job written by an earlier run ($LIBREYOLO_AGENT_CONFIG_DIR/job.toml)
# It is written to $LIBREYOLO_AGENT_CONFIG_DIR/job.toml, mode 0600. A job that fails
# `libreyolo-agent check` is reported loudly and the agent is started all the same: it takes the
# gated failure decision of the job's [teardown] instead of leaving the box billing with nothing
# running (where [teardown] itself cannot be read, it keeps the box and says so); this script
# then exits 3.
#
# Environment:
#   LIBREYOLO_AGENT_REPO      the git URL the start line above clones (set it in the provider's
#                             environment variables; this script itself does not read it)
#   HF_TOKEN, CONTAINER_API_KEY, VAST_API_KEY, RUNPOD_API_KEY, LAMBDA_API_KEY
#                             secrets, read from the environment only and never printed; on
#                             systemd they go to $LIBREYOLO_AGENT_CONFIG_DIR/env (mode 0600)
#   CONTAINER_ID, RUNPOD_POD_ID  the instance ids Vast and RunPod set (passed on to the agent)
#   HF_HOME                   the Hub cache; default: on the persistent volume when one is
#                             mounted (LIBREYOLO_AGENT_VOLUME, else /workspace, /runpod-volume)
#   LIBREYOLO_AGENT_VOLUME    a persistent volume's mount point, tried first for HF_HOME
#   HF_ENDPOINT               the Hub's URL (a mirror)
#   VENV                      the virtual environment (default: .venv in this repo)
#   LIBREYOLO_AGENT_CONFIG_DIR  default /etc/libreyolo-agent
#   LIBREYOLO_AGENT_STATE_DIR   default /var/lib/libreyolo-agent (supervisor.pid, logs)
#   LIBREYOLO_AGENT_INIT      auto (systemd when PID 1 is systemd), systemd or container
#   LIBREYOLO_AGENT_SYSTEMD_DIR where the unit goes (default /etc/systemd/system)
#   PYTHON                    the interpreter install.sh builds the venv from; before the
#                             venv exists, its huggingface_hub (when it has one) prefetches the
#                             job's dataset into the Hub cache while pip works
# install.sh's variables (TORCH_SPEC, PIP_ARGS, LIBREYOLO_EXTRAS, ...) pass through.
#
# Exit: 0 the agent runs (started now or already running); 1 a failure (install, fetch, lock);
# 2 a usage mistake or no job at all (nothing started); 3 the job is not valid and the agent
# was started to take the failure decision.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VENV="${VENV:-$here/.venv}"
venv="$VENV"
config_dir="${LIBREYOLO_AGENT_CONFIG_DIR:-/etc/libreyolo-agent}"
export LIBREYOLO_AGENT_STATE_DIR="${LIBREYOLO_AGENT_STATE_DIR:-/var/lib/libreyolo-agent}"
state_dir="$LIBREYOLO_AGENT_STATE_DIR"
unit_dir="${LIBREYOLO_AGENT_SYSTEMD_DIR:-/etc/systemd/system}"
init="${LIBREYOLO_AGENT_INIT:-auto}"
job_dest="$config_dir/job.toml"
# The unit file's own paths; anything else gets a drop-in that points it at ours.
unit_venv="/opt/libreyolo-agent/.venv"
unit_job="/etc/libreyolo-agent/job.toml"
unit_state="/var/lib/libreyolo-agent"
# Passed to the agent under systemd (its environment file); secrets among them are never printed.
env_names=(HF_TOKEN HF_ENDPOINT HF_HOME CONTAINER_ID CONTAINER_API_KEY VAST_API_KEY
  RUNPOD_POD_ID RUNPOD_API_KEY LAMBDA_API_KEY)

say() { printf 'bootstrap: %s\n' "$*"; }
die() { printf 'bootstrap: %s\n' "$1" >&2; exit "${2:-1}"; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed -n 's/^# \{0,1\}//p'; }

job_arg=""
install=1
while [ $# -gt 0 ]; do
  case "$1" in
    --job) [ $# -ge 2 ] || die "--job needs a path or an hf:// URL" 2; job_arg="$2"; shift ;;
    --job=*) job_arg="${1#--job=}" ;;
    --no-install) install=0 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" 2 ;;
  esac
  shift
done
case "$init" in
  auto) if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
          init=systemd
        else
          init=container
        fi ;;
  systemd|container) ;;
  *) die "LIBREYOLO_AGENT_INIT must be auto, systemd or container (got '$init')" 2 ;;
esac

umask 077
mkdir -p "$config_dir" "$state_dir"
# One bootstrap at a time (an on-start hook and a person may race).
if command -v flock >/dev/null; then
  exec 9>"$state_dir/bootstrap.lock"
  flock -n 9 || die "another bootstrap is running (lock $state_dir/bootstrap.lock)"
fi

# put_file DEST MODE < CONTENT: replace DEST atomically when its content differs.
# Sets `changed` to 1 when it wrote, leaves it alone otherwise.
changed=0
put_file() {
  local dest="$1" mode="$2" tmp
  mkdir -p "$(dirname "$dest")"
  tmp="$(mktemp "$dest.XXXXXX")"
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [ -f "$dest" ] && cmp -s "$tmp" "$dest"; then
    rm -f "$tmp"
    chmod "$mode" "$dest"
    say "unchanged: $dest"
    return 0
  fi
  mv -f "$tmp" "$dest"
  changed=1
  say "wrote $dest (mode $mode)"
}

# fetch_hf URL DEST: a file of a Hub repo, with the venv's huggingface_hub (HF_TOKEN and
# HF_ENDPOINT from the environment).
fetch_hf() {
  "$venv/bin/python" - "$1" "$2" <<'PY'
import os
import shutil
import sys

url, dest = sys.argv[1], sys.argv[2]
rest, repo_type = url[len("hf://"):], "model"
for prefix, kind in (("datasets/", "dataset"), ("spaces/", "space")):
    if rest.startswith(prefix):
        rest, repo_type = rest[len(prefix):], kind
parts = rest.split("/")
if len(parts) < 3 or not all(parts):
    sys.exit(f"bootstrap: {url!r} is not hf://[datasets/]org/repo[@revision]/path/to/job.toml")
repo_id, revision = "/".join(parts[:2]), None
if "@" in repo_id:
    repo_id, revision = repo_id.split("@", 1)
try:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(
        repo_id,
        "/".join(parts[2:]),
        repo_type=repo_type,
        revision=revision,
        token=os.environ.get("HF_TOKEN") or None,
    )
except Exception as exc:  # one readable line; the token is never part of the client's messages
    sys.exit(f"bootstrap: cannot fetch {url}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
shutil.copyfile(path, dest)
PY
}

# prefetch: when the job names a dataset on the Hub, download its archive into the Hub cache in
# the background, while pip works: the agent's staging (hf_hub_download into the same cache)
# then finds it there and downloads nothing (or waits on the client's lock while this one
# finishes). Any Python that has huggingface_hub will do: the venv's when there is one, else the
# one install.sh builds it from (a GPU image's often has it); with none, or a job without a
# dataset, or an agent already running, nothing is started and the agent downloads it as always.
# A failure here only leaves the download to the agent, which says what went wrong.
prefetch() {
  local py="$venv/bin/python"
  if [ ! -x "$py" ]; then
    py="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
  fi
  [ -n "$py" ] && [ -x "$(command -v "$py")" ] || return 0
  local log="$state_dir/prefetch.log"
  # Its own session (it outlives this script, as the supervisor does), without the lock's fd 9.
  local launcher=(nohup)
  if command -v setsid >/dev/null; then
    launcher=(setsid nohup)
  fi
  "${launcher[@]}" "$py" -c "$prefetch_py" "$job_dest" >>"$log" 2>&1 </dev/null 9>&- &
  say "prefetch: the job's dataset archive goes into the Hub cache in the background (pid $!, log $log)"
}
prefetch_py='
import importlib.util
import os
import sys
import time

try:
    import tomllib
except ImportError:  # Python 3.10 and older: the agent downloads it
    sys.exit(0)
with open(sys.argv[1], "rb") as f:
    try:
        ds = tomllib.load(f).get("dataset") or {}
    except ValueError:
        sys.exit(0)  # the check names the mistake
repo, name = ds.get("repo"), ds.get("file")
if not (isinstance(repo, str) and isinstance(name, str) and repo and name):
    sys.exit(0)
if importlib.util.find_spec("huggingface_hub") is None:
    print(f"prefetch: no huggingface_hub in {sys.executable}: the agent downloads {repo}/{name}")
    sys.exit(0)
from huggingface_hub import hf_hub_download

home = os.environ.get("HF_HOME")
start = time.monotonic()
print(f"prefetch: {repo}/{name} into the Hub cache", flush=True)
try:
    path = hf_hub_download(
        repo,
        name,
        repo_type="dataset",
        revision=ds.get("revision") if isinstance(ds.get("revision"), str) else None,
        cache_dir=os.path.join(home, "hub") if home else None,
        token=os.environ.get("HF_TOKEN") or False,
    )
except Exception as exc:  # one line; the token is never part of the client messages
    print(f"prefetch: not fetched ({type(exc).__name__}): the agent downloads it and says why")
    sys.exit(0)
print(f"prefetch: done in {time.monotonic() - start:.2f} s: {path}")
'

# agent_running: the supervised agent runs already (its unit under systemd, else the supervisor
# whose pid file names a live process).
agent_running() {
  if [ "$init" = systemd ]; then
    systemctl is-active --quiet libreyolo-agent
    return
  fi
  local pid_file="$state_dir/supervisor.pid" pid
  [ -r "$pid_file" ] || return 1
  pid="$(tr -cs '0-9' '\n' <"$pid_file" | sed -n '/./{p;q}')"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null \
    && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q 'supervise'
}

run_install() {
  if [ "$install" = 1 ]; then
    "$here/install.sh" "$@"
  elif [ ! -x "$venv/bin/libreyolo-agent" ]; then
    die "--no-install, but $venv/bin/libreyolo-agent is not there"
  fi
}

# ---- HF_HOME on the persistent volume, so downloads survive a restart
if [ -z "${HF_HOME:-}" ]; then
  for volume in "${LIBREYOLO_AGENT_VOLUME:-}" /workspace /runpod-volume; do
    if [ -n "$volume" ] && [ -d "$volume" ] && [ -w "$volume" ]; then
      export HF_HOME="$volume/.cache/huggingface"
      break
    fi
  done
fi
if [ -n "${HF_HOME:-}" ]; then
  mkdir -p "$HF_HOME"
  say "HF_HOME=$HF_HOME"
else
  say "no persistent volume found: the Hub cache stays in its default place"
fi

# ---- the job
if [ -n "$job_arg" ]; then
  job_from="$job_arg"
elif [ -n "${LIBREYOLO_AGENT_JOB_TOML:-}" ]; then
  job_from=""
else
  job_from="${LIBREYOLO_AGENT_JOB:-}"
fi
if [ -z "$job_from" ] && [ -n "${LIBREYOLO_AGENT_JOB_TOML:-}" ]; then
  source_desc="LIBREYOLO_AGENT_JOB_TOML"
  printf '%s\n' "$LIBREYOLO_AGENT_JOB_TOML" | put_file "$job_dest" 600
elif [[ "$job_from" == hf://* ]]; then
  source_desc="$job_from"
  run_install  # the Hub client lives in the venv; the job's extras come below
  fetched="$(mktemp "$state_dir/job.XXXXXX")"
  fetch_hf "$job_from" "$fetched" || { rm -f "$fetched"; exit 1; }
  put_file "$job_dest" 600 <"$fetched"
  rm -f "$fetched"
elif [ -n "$job_from" ]; then
  source_desc="$job_from"
  [ -r "$job_from" ] || die "cannot read the job file '$job_from'" 2
  if [ "$(realpath "$job_from")" != "$(realpath -m "$job_dest")" ]; then
    put_file "$job_dest" 600 <"$job_from"
  fi
elif [ -f "$job_dest" ]; then
  source_desc="the job of an earlier run"
else
  die "no job: pass --job PATH|hf://org/repo/job.toml, or set LIBREYOLO_AGENT_JOB_TOML (the TOML) or LIBREYOLO_AGENT_JOB (a path or an hf:// URL)" 2
fi
chmod 600 "$job_dest"
say "job: $job_dest (from $source_desc)"
if grep -Eq '^[[:space:]]*\[dataset\]' "$job_dest" && ! agent_running; then
  prefetch
fi

# ---- install, with the LibreYOLO extras the job needs
install_rc=0
run_install --job "$job_dest" || install_rc=$?
if [ "$install_rc" = 2 ] && [ "$install" = 1 ]; then
  # install.sh could not read the job's extras (a broken TOML): install without them; the check
  # below names the mistake and the agent takes the failure decision.
  say "install.sh could not read the job's extras: installing without them"
  run_install
elif [ "$install_rc" != 0 ]; then
  exit "$install_rc"
fi

# ---- start the agent, supervised
if [ "$init" = systemd ]; then
  changed=0
  put_file "$unit_dir/libreyolo-agent.service" 644 <"$here/systemd/libreyolo-agent.service"
  dropin="$unit_dir/libreyolo-agent.service.d/10-bootstrap.conf"
  if [ "$venv" != "$unit_venv" ] || [ "$job_dest" != "$unit_job" ] || [ "$state_dir" != "$unit_state" ]; then
    printf '[Service]\nEnvironment=LIBREYOLO_AGENT_STATE_DIR=%s\nExecStart=\nExecStart=%s run %s\n' \
      "$state_dir" "$venv/bin/libreyolo-agent" "$job_dest" | put_file "$dropin" 644
  elif [ -f "$dropin" ]; then
    rm -f "$dropin"
    changed=1
  fi
  unit_changed="$changed"
  changed=0
  for name in "${env_names[@]}"; do
    value="${!name:-}"
    [ -n "$value" ] || continue
    [[ "$value" != *$'\n'* ]] || die "$name holds a line break: not written to $config_dir/env"
    value="${value//\\/\\\\}"
    printf '%s="%s"\n' "$name" "${value//\"/\\\"}"
  done | put_file "$config_dir/env" 600
  if [ "$unit_changed" = 1 ]; then
    systemctl daemon-reload
  fi
  if systemctl is-active --quiet libreyolo-agent; then
    say "libreyolo-agent.service is running already"
    if [ "$changed" = 1 ]; then
      say "its environment changed: 'systemctl restart libreyolo-agent' applies it"
    fi
  fi
  systemctl enable --now libreyolo-agent
  say "started: systemctl status libreyolo-agent; journalctl -u libreyolo-agent -f"
else
  pid_file="$state_dir/supervisor.pid"
  running=""
  if [ -r "$pid_file" ]; then
    pid="$(tr -cs '0-9' '\n' <"$pid_file" | sed -n '/./{p;q}')"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null \
        && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q 'supervise'; then
      running="$pid"
    fi
  fi
  if [ -n "$running" ]; then
    say "the supervisor runs already (pid $running): nothing to start"
  else
    log="$state_dir/supervisor.out"
    launcher=(nohup)
    if command -v setsid >/dev/null; then
      launcher=(setsid nohup)
    fi
    # Its own session: it outlives this script, the on-start hook and any SSH session. It must
    # not inherit the bootstrap lock (fd 9), or no later bootstrap could ever run.
    "${launcher[@]}" "$venv/bin/libreyolo-agent" supervise "$job_dest" >>"$log" 2>&1 </dev/null 9>&- &
    say "started the supervisor (pid $!): log $log, state $state_dir"
  fi
fi

# ---- the job check: after the start, which does not wait for it (a job that fails it is
# started all the same, and the agent takes the failure decision), so the agent's preflight and
# staging are not delayed by it
job_ok=1
if ! "$venv/bin/libreyolo-agent" check "$job_dest"; then
  job_ok=0
  cat >&2 <<EOF
bootstrap: ====================================================================================
bootstrap: THE JOB FILE IS NOT VALID: $job_dest (from $source_desc); its errors are above.
bootstrap: The agent is started all the same: it cannot train this job, so it takes the job's
bootstrap: gated failure decision ([teardown] on_preflight_failure; where [teardown] itself cannot
bootstrap: be read it keeps the box and says so), visible in its log, /status and notifications.
bootstrap: Fix the job (check it on your laptop first: libreyolo-agent check JOB); the agent
bootstrap: records this ending in $state_dir/state.json: remove that file before the fixed job
bootstrap: can run on this box. This script exits 3 once the agent is started.
bootstrap: ====================================================================================
EOF
fi

state_opt=""
if [ "$state_dir" != "$unit_state" ]; then
  state_opt=" --state-dir $(printf '%q' "$state_dir")"
fi
cat <<EOF

Reach it from your own machine through an SSH tunnel (use the box's SSH host and port):
  ssh -p <port> root@<host> -N -L 8421:127.0.0.1:8421 -L 8420:127.0.0.1:8420
  curl http://127.0.0.1:8421/status          (or open http://127.0.0.1:8421/ for the dashboard;
                                               8421 unless the job's server.listen says otherwise)
  on the box: $venv/bin/libreyolo-agent status --watch$state_opt
  the control token (the page's buttons, POST /stop and the like) is in $state_dir/token,
  readable by the agent's user only; print it with: $venv/bin/libreyolo-agent token$state_opt
  or a link that logs the page in (open it once, through the tunnel):
    $venv/bin/libreyolo-agent token --login-url$state_opt
  the training dashboard: on the box, $venv/bin/libreyolo monitor <run dir> --no-browser, then open
  http://127.0.0.1:8420 here
EOF
if [ "$job_ok" = 0 ]; then
  printf 'bootstrap: %s\n' "the job file is not valid (see above): the agent was started to take the failure decision" >&2
  exit 3
fi
