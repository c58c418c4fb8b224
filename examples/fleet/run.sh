#!/usr/bin/env bash
# The on-box side of the fleet recipes (examples/fleet/*.yaml, *.dstack.yml): the engine's run
# step calls it once ./install.sh has built the venv. It writes the job the environment carries
# and runs the agent in the foreground (the engine watches this process), with the engine's
# exit codes: 0 completed, 75 the box failed (relaunch the job elsewhere), 65 the job ended and
# would end so again (do not relaunch); README, "Many boxes".
#
# Environment:
#   LIBREYOLO_AGENT_JOB_TOML  the job's TOML text, or
#   LIBREYOLO_AGENT_JOB       a job file on the box (the engine's file mounts put it there)
#   LIBREYOLO_AGENT_JOB_VARS  names of variables whose ${NAME} in the TOML text is replaced by
#                             their value: a sweep's hyperparameters, e.g. "LR MOSAIC"
#   LIBREYOLO_AGENT_BOX_DIR   job.toml, state/ and a relative job.runs_dir go here
#                             (default: $HOME/libreyolo-agent)
#   LIBREYOLO_AGENT_STATE_DIR the agent's state (default: $LIBREYOLO_AGENT_BOX_DIR/state)
#   VENV                      the venv install.sh built (default: .venv in this repository)
# and whatever the agent reads (HF_TOKEN, HF_HOME, SKYPILOT_TASK_ID or DSTACK_RUN_NAME: the
# run's id, the same on every box the engine relaunches it on).
set -euo pipefail

# 65: without a job there is nothing a relaunch could fix.
die() { printf 'fleet: %s\n' "$1" >&2; exit 65; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VENV:-$here/.venv}"
box="${LIBREYOLO_AGENT_BOX_DIR:-$HOME/libreyolo-agent}"
export LIBREYOLO_AGENT_STATE_DIR="${LIBREYOLO_AGENT_STATE_DIR:-$box/state}"
umask 077
mkdir -p "$box"
job="$box/job.toml"
if [ -n "${LIBREYOLO_AGENT_JOB_TOML:-}" ]; then
  toml="$LIBREYOLO_AGENT_JOB_TOML"
  for name in ${LIBREYOLO_AGENT_JOB_VARS:-}; do
    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "LIBREYOLO_AGENT_JOB_VARS: '$name' is not a variable name"
    [ -n "${!name+set}" ] || die "LIBREYOLO_AGENT_JOB_VARS names $name, which is not set"
    # Quoted pattern and replacement: both literal (no glob, no '&' of bash 5.2).
    toml="${toml//"\${$name}"/"${!name}"}"
  done
  printf '%s\n' "$toml" >"$job.part"
  mv -f "$job.part" "$job"
elif [ -n "${LIBREYOLO_AGENT_JOB:-}" ]; then
  [ -r "$LIBREYOLO_AGENT_JOB" ] || die "cannot read the job file '$LIBREYOLO_AGENT_JOB'"
  job="$LIBREYOLO_AGENT_JOB"
else
  die "no job: set LIBREYOLO_AGENT_JOB_TOML (the TOML) or LIBREYOLO_AGENT_JOB (a file on the box)"
fi
printf 'fleet: job %s, state %s, run id %s\n' "$job" "$LIBREYOLO_AGENT_STATE_DIR" \
  "${LIBREYOLO_AGENT_RUN_ID:-${SKYPILOT_TASK_ID:-${DSTACK_RUN_NAME:-none}}}"
exec "$venv/bin/libreyolo-agent" run --exit-codes engine "$job"
