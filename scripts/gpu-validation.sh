#!/usr/bin/env bash
# The GPU proof behind docs/gpu-validation.md, run on a rented-style GPU box whose image already
# has a CUDA torch (python3). Wheels for libreyolo and the few packages the image lacks are
# expected in .whl/ (see docs/gpu-validation.md). Results go to $OUT (default ./gpu-out).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
# No .whl/ (a box whose python3 already has everything, or a CPU rehearsal): nothing to install.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
agent() { python3 -m agent.cli "$@"; }
now() { date +%s.%N; }
{
  echo "== machine"; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  libreyolo --version 2>/dev/null || python3 -c 'import libreyolo; print(libreyolo.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

only="${1:-all}"   # all | reattach | issue8 | issue11 | issue14 | issue15

if [ "$only" = issue15 ]; then
# Issue 15, the whole job on a real GPU with the finished agent: the dataset staged from a (fake)
# Hugging Face Hub, checkpoints synced to hf:// every epoch, the box torn down through a (fake)
# vast.ai API, preflight on with its defaults; both fakes (tests/fakes) run on 127.0.0.1 from
# scripts/gpu_issue15.py. (1) yolox-n and yolo9-t run to completion: exit, wall time, phases,
# start-up, teardown read-back, Hub sha256 == local, agent peak RSS and CPU; (2) the yolox-n job
# under `agent stop`, an agent SIGKILL (a second agent re-attaches), a reboot-style kill (agent
# and trainer tree, another boot id: resume); (3) bench/run.py P1,P6,P7 on this device.
# Hub transfers keep the agent's default (HF_HUB_DISABLE_XET unset: checkpoints go up over Git
# LFS, which the fake speaks). DEVICE=cpu rehearses it all on a CPU box with smaller settings (the bench only with BENCH=1;
# BENCH=0 skips it on a GPU).
R="$OUT/issue15.txt"; B=/tmp/i15; DEV="${DEVICE:-0}"
rm -rf "$B"; mkdir -p "$B"
say() { echo "[$(date +%H:%M:%S)] $*"; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }
if [ "$DEV" = cpu ]; then
  IMG=64; BATCH=4; WORKERS=0; EP_WHOLE=3; EP_KILL=6; ALLOW_CPU=true
else
  IMG=320; BATCH=16; WORKERS=2; EP_WHOLE=6; EP_KILL=9; ALLOW_CPU=false
fi
echo "== issue 15: the whole job on device $DEV (imgsz $IMG, batch $BATCH, workers $WORKERS," \
  "epochs $EP_WHOLE / $EP_KILL), dataset and sync on a fake Hub, teardown on a fake vast.ai" | tee "$R"
H15="python3 scripts/gpu_issue15.py"
i15_cleanup() {
  [ -n "${i15_serve:-}" ] && kill -TERM "$i15_serve" 2>/dev/null && wait "$i15_serve" 2>/dev/null
  i15_serve=""
  $H15 cleanup "$B"/*/state 2>/dev/null
}
trap i15_cleanup EXIT
$H15 serve "$B/serve" > "$B/serve.log" 2>&1 & i15_serve=$!
for _ in $(seq 1 150); do [ -s "$B/serve/serve.env" ] && break; sleep 0.2; done
if [ ! -s "$B/serve/serve.env" ]; then
  echo "the fake servers did not start:" >> "$R"; cat "$B/serve.log" >> "$R"; cat "$R"; exit 1
fi
# shellcheck disable=SC1091
. "$B/serve/serve.env"; say "$(cat "$B/serve.log")"
# The agent's environment, per command: the Hub (token, endpoint) and the vast key; CONTAINER_ID
# is added per job (Vast sets it in every instance). Nothing of it is exported to the bench.
# shellcheck disable=SC2054  # NO_PROXY's value is a comma list, not array elements
HUBENV=(HF_ENDPOINT="$HF_ENDPOINT" HF_TOKEN="$HF_TOKEN" HF_HOME="$B/hf" HF_HUB_DISABLE_TELEMETRY=1
  NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
  VAST_API_KEY="$VAST_API_KEY")
unset HF_ENDPOINT HF_TOKEN VAST_API_KEY   # in case the caller had them exported
mkjob() { # $1 dir, $2 job name, $3 model, $4 epochs
cat > "$1/job.toml" <<TOML
[job]
name = "$2"
runs_dir = "$1/runs"
[train]
model = "$3"
pretrained = false
epochs = $4
imgsz = $IMG
batch = $BATCH
workers = $WORKERS
device = "$DEV"
save_period = 3
[dataset]
repo = "$DATA_REPO"
file = "$DATA_FILE"
dest = "$1/data"
data_yaml = "boxes/data.yaml"
[sync]
target = "hf://gpu-i15/$2"
every_epochs = 1
[teardown]
provider = "vast"
api_url = "$VAST_URL"
[preflight]
allow_cpu = $ALLOW_CPU
[server]
listen = "127.0.0.1:0"
TOML
}
run_agent() { # $1 dir, $2 instance id, $3 log name, [$4 VAR=value]; the agent in the background -> $apid
  env "${HUBENV[@]}" CONTAINER_ID="$2" ${4:+"$4"} python3 -m agent.cli run "$1/job.toml" > "$1/$3" 2>&1 &
  apid=$!
}
epoch_of() { agent status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2>/dev/null; }
wait_epoch() { # $1 epoch, $2 agent pid: 0 once reached, 1 when the agent ended or 300 s passed
  for _ in $(seq 1 600); do
    kill -0 "$2" 2>/dev/null || return 1
    e=$(epoch_of); [ "${e:-0}" -ge "$1" ] && return 0; sleep 0.5
  done; return 1
}
trainer_pid() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['trainer']['pid'])" "$1/state/state.json" 2>/dev/null; }
nvml_hosts() { pgrep -fc 'agent/nvml\.py' || true; }   # the agent's NVML host processes
gpu_busy() { [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d '[:space:]')" ]; }

# (1) whole jobs
iid=1500
for model in yolox-n yolo9-t; do
  iid=$((iid + 1)); D="$B/$model"; mkdir -p "$D"; mkjob "$D" "i15-$model" "$model" "$EP_WHOLE"
  export LIBREYOLO_AGENT_STATE_DIR="$D/state"
  say "(1) $model: whole job, $EP_WHOLE epochs (vast instance $iid)"
  t0=$(now); run_agent "$D" "$iid" agent.log
  $H15 sample "$apid" "$D/usage.json" & spid=$!
  wait "$apid"; rc=$?; t1=$(now); wait "$spid" 2>/dev/null
  say "(1) $model: agent exit $rc after $(secs "$t0" "$t1") s"
  echo "-- (1) $model whole job: agent exit $rc, wall $(secs "$t0" "$t1") s" >> "$R"
  CONTAINER_ID=$iid $H15 report "$D" "i15-$model" "$B/serve" "$t0" >> "$R" 2>&1
  # Checkpoints copied while LibreYOLO wrote them (agent/sync/follow.py) and used as snapshots.
  echo "  $(grep -ho 'checkpoints copied while written.*' "$D/state/agent.log" | tail -1)" >> "$R"
  # The warm start: preflight's probe ran in the trainer's own Python (agent/trainer/warm_entry.py).
  echo "  $(grep -ho 'preflight passed in.*' "$D/state/agent.log" | tail -1);" \
    "$(grep -ho 'trainer started pid=.*' "$D/state/agent.log" | tail -1)" >> "$R"
done

# WHOLE_ONLY=1: the whole jobs of (1) only (a short device budget).
if [ "${WHOLE_ONLY:-0}" != 1 ]; then
# (2) the yolox-n job, longer, under a stop, an agent SIGKILL and a reboot-style kill
# (a) agent stop at epoch >= 2
D="$B/stop"; mkdir -p "$D"; mkjob "$D" i15-stop yolox-n "$EP_KILL"; iid=1503
export LIBREYOLO_AGENT_STATE_DIR="$D/state"
say "(2a) agent stop at epoch >= 2"
run_agent "$D" "$iid" agent.log; a1=$apid
if wait_epoch 2 "$a1"; then
  e=$(epoch_of); tp=$(trainer_pid "$D"); t0=$(now)
  $H15 gone "${tp:-0}" "$t0" > "$D/gone.txt" 2>&1 & gpid=$!
  agent stop > "$D/stop.out" 2>&1
  free="skipped (DEVICE=cpu)"
  if [ "$DEV" != cpu ]; then
    free="not within 120 s"
    for _ in $(seq 1 1200); do gpu_busy || { free="$(secs "$t0" "$(now)") s"; break; }; sleep 0.1; done
  fi
  wait "$a1"; rc=$?; t1=$(now); wait "$gpid" 2>/dev/null
  echo "-- (2a) agent stop at epoch $e: agent exit $rc after $(secs "$t0" "$t1") s; stop -> GPU free (nvidia-smi compute apps empty): $free; stop -> trainer tree gone: $(cat "$D/gone.txt")" >> "$R"
  sed 's/^/  stop says: /' "$D/stop.out" | head -3 >> "$R"
else
  agent stop > /dev/null 2>&1; wait "$a1"; echo "-- (2a) the job never reached epoch 2 (agent exit $?)" >> "$R"
fi
CONTAINER_ID=$iid $H15 report "$D" i15-stop "$B/serve" >> "$R" 2>&1
# Where the stop's seconds go: the agent's lines and the trainer's last words, timestamped.
cp "$D/agent.log" "$OUT/issue15-stop-agent.log" 2>/dev/null
tail -c 20000 "$D/state/trainer.log" > "$OUT/issue15-stop-trainer.log" 2>/dev/null

# (b) agent SIGKILL at epoch >= 2; a second agent re-attaches to the same trainer and finishes
D="$B/reattach"; mkdir -p "$D"; mkjob "$D" i15-reattach yolox-n "$EP_KILL"; iid=1504
export LIBREYOLO_AGENT_STATE_DIR="$D/state"
say "(2b) agent SIGKILL at epoch >= 2, a second agent re-attaches"
run_agent "$D" "$iid" agent1.log; a1=$apid
wait_epoch 2 "$a1"; e=$(epoch_of)
hosts_before=$(nvml_hosts)
kill -9 "$a1"; wait "$a1" 2>/dev/null
tp=$(trainer_pid "$D")
alive=$(kill -0 "${tp:-0}" 2>/dev/null && echo alive || echo gone)
sleep 1; hosts_after=$(nvml_hosts)   # the dead agent's NVML host read end of input and left
t0=$(now); run_agent "$D" "$iid" agent2.log; wait "$apid"; rc=$?
echo "-- (2b) agent SIGKILLed at epoch $e (trainer $tp $alive); second agent exit $rc after $(secs "$t0" "$(now)") s" >> "$R"
echo "  NVML hosts running: $hosts_before before the SIGKILL, $hosts_after 1 s after it (must be 0)" >> "$R"
echo "  'trainer started' lines: first agent $(grep -c 'trainer started' "$D/agent1.log"), second $(grep -c 'trainer started' "$D/agent2.log") (must total 1); 're-attached to trainer' in the second: $(grep -c 're-attached to trainer' "$D/agent2.log")" >> "$R"
CONTAINER_ID=$iid $H15 report "$D" i15-reattach "$B/serve" >> "$R" 2>&1

# (c) reboot: agent and the whole trainer tree SIGKILLed at epoch >= 3, another boot id resumes
D="$B/reboot"; mkdir -p "$D"; mkjob "$D" i15-reboot yolox-n "$EP_KILL"; iid=1505
export LIBREYOLO_AGENT_STATE_DIR="$D/state"
say "(2c) reboot-style kill at epoch >= 3, resume under another boot id"
run_agent "$D" "$iid" agent1.log; a1=$apid
wait_epoch 3 "$a1"; e=$(epoch_of)
tp=$(trainer_pid "$D")
# A reboot ends everything: the agent, its trainer tree and its guard (no teardown of its own).
$H15 kill-tree "$a1" "${tp:-0}" "$D/state" >> "$D/kill.txt" 2>&1; wait "$a1" 2>/dev/null
t0=$(now)
run_agent "$D" "$iid" agent2.log LIBREYOLO_AGENT_BOOT_ID=simulated-reboot; wait "$apid"; rc=$?
echo "-- (2c) agent + trainer tree SIGKILLed at epoch $e ($(cat "$D/kill.txt")); agent under boot id simulated-reboot exit $rc after $(secs "$t0" "$(now)") s" >> "$R"
grep -E "rebooted|resum" "$D/agent2.log" | head -4 | cut -c1-220 | sed 's/^/  log: /' >> "$R"
CONTAINER_ID=$iid $H15 report "$D" i15-reboot "$B/serve" >> "$R" 2>&1
unset LIBREYOLO_AGENT_STATE_DIR
echo "-- NVML hosts left running after every scenario: $(nvml_hosts) (must be 0)" >> "$R"
fi
# How the checkpoints went up (the agent's default: Git LFS, HF_HUB_DISABLE_XET unset above).
python3 -c 'import json,sys; print("-- fake Hub requests by route:", json.load(open(sys.argv[1]))["hub_routes"])' \
  "$B/serve/vast.json" >> "$R" 2>&1
i15_cleanup

# (3) the benchmark on this device
# BENCH: 1 runs it (the default on a GPU), 0 skips it (the default on DEVICE=cpu).
if [ "${BENCH:-$([ "$DEV" = cpu ] && echo 0 || echo 1)}" = 1 ]; then
  say "(3) bench/run.py --only P1,P6,P7 --repeat 2 --device $DEV"
  t0=$(now)
  python3 bench/run.py --only P1,P6,P7 --repeat 2 --device "$DEV" --out "$OUT/RESULTS-gpu.md" \
    > "$B/bench.log" 2>&1
  echo "-- (3) bench/run.py P1,P6,P7 on device $DEV: exit $? after $(secs "$t0" "$(now)") s ($OUT/RESULTS-gpu.md)" >> "$R"
  grep -E '^\| P[167] ' "$OUT/RESULTS-gpu.md" >> "$R" 2>/dev/null || tail -20 "$B/bench.log" >> "$R"
else
  echo "-- (3) bench skipped (BENCH=0; run it with BENCH=1)" >> "$R"
fi
cp "$B/yolox-n/agent.log" "$OUT/issue15-agent.log" 2>/dev/null
say "done"
cat "$R"
exit 0
fi

if [ "$only" = issue14 ]; then
# Issues 13/14 on the GPU: (1) the install-time torch choice on this box (agent/install/torchpick.py);
# (2) LibreYOLO's profiler through agent/watch/profiling.py on the H200, offline, with a checkpoint of
# the job's family and size; (3) a short agent run whose sizing verdict and projection come from
# NVML and the trainer tree's CPU (the log line after epoch 1, /status sizing).
R="$OUT/issue14.txt"; echo "== issue 14: torch choice, profiler on the GPU, sizing verdict" | tee "$R"
echo "-- (1) python3 -m agent.install.torchpick" >> "$R"
python3 -m agent.install.torchpick >> "$R" 2>&1 || echo "torchpick exit $?" >> "$R"
python3 -c 'from pathlib import Path; from agent import demo; demo.make_dataset(Path("/tmp/i14/data"), train=64, val=16)'
libreyolo train model=yolox-n pretrained=false data=/tmp/i14/data/data.yaml epochs=1 imgsz=320 batch=16 \
  workers=4 device=0 project=/tmp/i14/w name=r json=true > /tmp/i14/w.out 2>&1
echo "-- (2) profiler on GPU 0 with /tmp/i14/w/r/weights/last.pt (yolox n)" >> "$R"
HF_HUB_OFFLINE=1 python3 - >> "$R" 2>&1 <<'PY'
import asyncio, json, os
from pathlib import Path
from agent.config.jobfile import parse_job
from agent.watch.profiling import run_profile
job = parse_job("""
[train]
model = "/tmp/i14/w/r/weights/last.pt"
data = "/tmp/i14/data/data.yaml"
imgsz = 320
batch = 16
workers = 4
device = "0"
epochs = 40
[profile]
enabled = true
steps = 20
warmup = 3
timeout = "4m"
""", source="gpu", train_options=None)
r = asyncio.run(run_profile(job, work_dir=Path("/tmp/i14/profile"), cpu_count=os.cpu_count()))
d = r.to_dict()
print(json.dumps({k: d[k] for k in ("ran", "message", "img_per_s", "gpu_util_pct", "bound", "seconds", "notes")}, indent=1))
print("argv:", " ".join(r.argv))
PY
echo "-- (3) sizing during a short run (price 3.48 USD/h)" >> "$R"
D=/tmp/i14/run; mkdir -p $D
cat > $D/job.toml <<TOML
[job]
name = "gpu-i14"
runs_dir = "$D/runs"
[train]
model = "yolox-n"
pretrained = false
data = "/tmp/i14/data/data.yaml"
epochs = 6
imgsz = 320
batch = 16
workers = 4
device = "0"
[limits]
price_usd_per_hour = 3.48
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
TOML
export LIBREYOLO_AGENT_STATE_DIR=$D/state
python3 -m agent.cli run $D/job.toml > $D/agent.log 2>&1; echo "agent exit $?" >> "$R"
grep -E "sizing:|NVML|job gpu-i14 done" $D/agent.log | cut -c1-260 >> "$R"
python3 - "$D" >> "$R" <<'PY'
import json, sys
from pathlib import Path
r = json.loads((Path(sys.argv[1]) / "state" / "report.json").read_text())
print("report headline:", r.get("headline"))
PY
cat "$R"
exit 0
fi

if [ "$only" = issue11 ]; then
# Issue 11 on the GPU: (1) a reboot (agent and trainer SIGKILLed, another boot id) resumes from
# last.pt in the same run dir and reaches every epoch; NVML load seen by the stall watch;
# (2) SIGTERM declared a preemption: last.pt saved, trainer stopped, agent exits; the next boot
# resumes (kind preempted) and completes.
R="$OUT/issue11.txt"; echo "== issue 11: resume after a reboot, SIGTERM preemption, NVML" | tee "$R"
python3 -c 'from pathlib import Path; from agent import demo; demo.make_dataset(Path("/tmp/i11/data"), train=64, val=16)'
mkjob() { # $1 dir, $2 extra sections
cat > "$1/job.toml" <<TOML
[job]
name = "gpu-i11"
runs_dir = "$1/runs"
[train]
model = "yolox-n"
pretrained = false
data = "/tmp/i11/data/data.yaml"
epochs = 9
imgsz = 320
batch = 16
workers = 2
device = "0"
save_period = 3
[sync]
target = "file://$1/synced"
every_epochs = 1
[limits]
stall_timeout = "2m"
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
$2
TOML
}
epoch_of() { agent status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2>/dev/null; }
wait_epoch() { for _ in $(seq 1 600); do e=$(epoch_of); [ "${e:-0}" -ge "$1" ] && return 0; sleep 0.3; done; return 1; }
# (1) reboot
D=/tmp/i11/reboot; mkdir -p $D; mkjob $D ""; export LIBREYOLO_AGENT_STATE_DIR=$D/state
python3 -m agent.cli run $D/job.toml > $D/agent1.log 2>&1 & a1=$!
wait_epoch 3
agent status --json | python3 -c 'import json,sys; s=json.load(sys.stdin)["supervision"]["stall"]; print("stall watch:", json.dumps({k: s.get(k) for k in ("threshold_s","quiet_s","mean_epoch_s","gpus")}))' >> "$R"
tp=$(python3 -c "import json; print(json.load(open('$D/state/state.json'))['trainer']['pid'])")
kill -9 $a1; python3 -c "import psutil; p=psutil.Process($tp); ps=[p,*p.children(recursive=True)]; [q.kill() for q in ps]; psutil.wait_procs(ps, timeout=30)"
wait $a1 2>/dev/null
echo "(1) agent and trainer SIGKILLed at epoch $(python3 -c "import json; print(json.load(open('$D/runs/gpu-i11/status.json'))['completed_epochs'])")" >> "$R"
t0=$(now); LIBREYOLO_AGENT_BOOT_ID=simulated-reboot python3 -m agent.cli run $D/job.toml > $D/agent2.log 2>&1; echo "second agent exit $? after $(python3 -c "print(round($(now)-$t0,1))") s" >> "$R"
grep -E "rebooted|resume|relaunch|trainer outcome|job gpu-i11 done|GPU|NVML" $D/agent2.log | cut -c1-220 >> "$R"
python3 - "$D" >> "$R" <<'PY'
import hashlib, json, sys
from pathlib import Path
d = Path(sys.argv[1]); run = d / "runs"
st = json.loads((run / "gpu-i11" / "status.json").read_text())
rows = [json.loads(l)["epoch"] for l in (run / "gpu-i11" / "metrics.jsonl").read_text().splitlines()]
h = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
state = json.loads((d / "state" / "state.json").read_text())
print("run dirs:", sorted(p.name for p in run.iterdir()), "start_epoch:", st["start_epoch"], "state:", st["state"])
print("metrics epochs == 1..9 once each:", rows == list(range(1, 10)))
print("last.pt local/target sha256:", h(run / "gpu-i11/weights/last.pt"), h(d / "synced/weights/last.pt"))
print("reason:", state["reason"], "resumes:", [(r["kind"], r["epoch"]) for r in state["resumes"]])
PY
# (2) SIGTERM as a preemption notice
D=/tmp/i11/preempt; mkdir -p $D; mkjob $D "[preemption]
sigterm = true"; export LIBREYOLO_AGENT_STATE_DIR=$D/state
python3 -m agent.cli run $D/job.toml > $D/agent1.log 2>&1 & a1=$!
wait_epoch 3
t0=$(now); kill -TERM $a1; wait $a1; echo "(2) SIGTERM at epoch $(epoch_of 2>/dev/null || true): agent exit $? after $(python3 -c "print(round($(now)-$t0,2))") s" >> "$R"
grep -E "preempt|saving now|trainer stopped|uploaded\+verified weights/last.pt" $D/agent1.log | cut -c1-200 >> "$R"
LIBREYOLO_AGENT_BOOT_ID=after-preemption python3 -m agent.cli run $D/job.toml > $D/agent2.log 2>&1; echo "next boot exit $?" >> "$R"
python3 -c "import json; s=json.load(open('$D/state/state.json')); print('reason:', s['reason'], 'resumes:', [(r['kind'], r['epoch']) for r in s['resumes']])" >> "$R"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$R"
cat "$R"
exit 0
fi

if [ "$only" = issue8 ]; then
# Issue 8 on the GPU: (1) agent CPU while a stopped trainer winds down (it busy-looped: 26.5 s of
# CPU in a 47 s life); (2) trainer exit -> DONE without a redundant re-upload; (3) an agent
# SIGKILLed right after the launch never starts a second trainer.
echo "== issue 8: agent CPU during a stop, exit -> DONE, kill right after launch" | tee "$OUT/issue8.txt"
python3 -c 'from pathlib import Path; from agent import demo; demo.make_dataset(Path("/tmp/i8/data"))'
cat > /tmp/i8/job.toml <<TOML
[job]
name = "gpu-i8"
runs_dir = "/tmp/i8/runs"
[train]
model = "yolox-n"
pretrained = false
data = "/tmp/i8/data/data.yaml"
epochs = 300
imgsz = 64
batch = 4
workers = 2
device = "0"
save_period = 5
stop_grace = "60s"
[sync]
target = "file:///tmp/i8/synced"
[preflight]
enabled = false
[server]
listen = "127.0.0.1:8423"
TOML
export LIBREYOLO_AGENT_STATE_DIR=/tmp/i8/state
LIBREYOLO_AGENT_CRASHPOINT=after-launch python3 -m agent.cli run /tmp/i8/job.toml > /tmp/i8/agent0.log 2>&1
echo "agent with crashpoint after-launch exit $? (137 = SIGKILLed as planned)" >> "$OUT/issue8.txt"
python3 -m agent.cli run /tmp/i8/job.toml > /tmp/i8/agent1.log 2>&1 &
a1=$!
for _ in $(seq 1 240); do
  e=$(agent status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2>/dev/null)
  [ "${e:-0}" -ge 6 ] && break; sleep 0.5
done
cpu() { python3 -c "import psutil,sys; t=psutil.Process($a1).cpu_times(); print(f'{t.user+t.system:.2f}')"; }
c0=$(cpu); t0=$(now)
# The trainer is paused so the stop grace really runs (a hung trainer ignoring SIGINT).
tp=$(python3 -c 'import json; print(json.load(open("/tmp/i8/state/state.json"))["trainer"]["pid"])')
kill -STOP "$tp"; agent stop >> "$OUT/issue8.txt" 2>&1; sleep 10
c1=$(cpu); t1=$(now); kill -CONT "$tp"
wait $a1; echo "agent exit $?" >> "$OUT/issue8.txt"
python3 -c "print(f'agent CPU over {$t1-$t0:.1f} s of stop grace: {$c1-$c0:.2f} s (busy loop would be ~{$t1-$t0:.0f} s)')" | tee -a "$OUT/issue8.txt"
python3 - >> "$OUT/issue8.txt" <<'PY'
import json
s = json.load(open("/tmp/i8/state/state.json"))
t = {h["to"]: h["at"] for h in s["history"] if "to" in h}
print("reason", s["reason"], "| outcome", s["outcome"]["kind"], "| trainer pid", s["trainer"]["pid"])
print(f"FINISHING -> DONE: {t['DONE'] - t['FINISHING']:.2f} s")
adopted = sum("adopted trainer" in line for line in open("/tmp/i8/agent1.log"))
started = sum("trainer started" in line for line in open("/tmp/i8/agent0.log"))
print(f"trainers started: {started} (first agent, killed after launch); adopted by the second: {adopted}")
PY
grep -c "uploaded+verified weights/last.pt" /tmp/i8/agent1.log | sed 's/^/last.pt uploads: /' >> "$OUT/issue8.txt"
ls /tmp/i8/runs >> "$OUT/issue8.txt"
cp /tmp/i8/agent1.log "$OUT/issue8-agent.log"
exit 0
fi
if [ "$only" = all ]; then
bare='import torch; a = torch.randn(2000, 2000, device="cuda"); b = a @ a; torch.cuda.synchronize(); print(float(b.abs().sum()))'
echo "== timing: bare recipe vs preflight, alternated (first bare run warms the file cache)" | tee "$OUT/timing.txt"
for i in 1 2 3; do
  t0=$(now); python3 -c "$bare" >/dev/null; t1=$(now)
  agent preflight --json > "$OUT/preflight.json"; rc=$?; t2=$(now)
  python3 -c "b=$t1-$t0; p=$t2-$t1; print(f'round $i: bare {b:.2f}s  preflight {p:.2f}s (exit $rc)  ratio {p/b:.2f}')" | tee -a "$OUT/timing.txt"
done
agent preflight > "$OUT/preflight-table.txt" 2>&1

echo "== demo job on the GPU" | tee "$OUT/demo.txt"
( cd /tmp && agent run --demo-dir /tmp/demo ) >> "$OUT/demo.txt" 2>&1; echo "exit $?" >> "$OUT/demo.txt"
grep -h '"device"' /tmp/demo/state/trainer-result.json >> "$OUT/demo.txt" 2>/dev/null

echo "== stop mid-run on the GPU, then nothing holds the GPU" | tee "$OUT/stop.txt"
python3 - <<'PY' >> "$OUT/stop.txt" 2>&1
from agent import demo
demo.make_dataset(__import__("pathlib").Path("/tmp/stopjob/data"))
PY
cat > /tmp/stopjob/job.toml <<TOML
[job]
name = "gpu-stop"
runs_dir = "/tmp/stopjob/runs"
[train]
model = "yolox-n"
pretrained = false
data = "/tmp/stopjob/data/data.yaml"
epochs = 300
imgsz = 64
batch = 4
workers = 2
device = "0"
[sync]
target = "file:///tmp/stopjob/synced"
[preflight]
allow_cpu = false
[server]
listen = "127.0.0.1:8421"
TOML
export LIBREYOLO_AGENT_STATE_DIR=/tmp/stopjob/state
python3 -m agent.cli run /tmp/stopjob/job.toml > "$OUT/stop-agent.log" 2>&1 &
apid=$!
for _ in $(seq 1 120); do
  e=$(agent status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2>/dev/null)
  [ "${e:-0}" -ge 3 ] && break; sleep 1
done
echo "before stop:" >> "$OUT/stop.txt"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/stop.txt"
agent stop >> "$OUT/stop.txt" 2>&1
wait $apid; echo "agent exit $?" >> "$OUT/stop.txt"
sleep 1
echo "after stop:" >> "$OUT/stop.txt"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/stop.txt"
python3 -c 'import json; s=json.load(open("/tmp/stopjob/state/state.json")); print("reason", s["reason"], "|", s["outcome"], "|", s["cause"])' >> "$OUT/stop.txt"
echo "-- weights after the stop:" >> "$OUT/stop.txt"; ls -la /tmp/stopjob/runs/*/weights >> "$OUT/stop.txt"
echo "-- synced:" >> "$OUT/stop.txt"; ls -la /tmp/stopjob/synced/weights >> "$OUT/stop.txt"
cp /tmp/stopjob/state/trainer.log "$OUT/stop-trainer.log"
fi

echo "== agent SIGKILL mid-run on the GPU, a new agent re-attaches (no second trainer)" | tee "$OUT/reattach.txt"
python3 -c 'from pathlib import Path; from agent import demo; demo.make_dataset(Path("/tmp/rj/data"))'
cat > /tmp/rj/job.toml <<TOML
[job]
name = "gpu-reattach"
runs_dir = "/tmp/rj/runs"
[train]
model = "yolox-n"
pretrained = false
data = "/tmp/rj/data/data.yaml"
epochs = 40
imgsz = 64
batch = 4
workers = 2
device = "0"
save_period = 10
[sync]
target = "file:///tmp/rj/synced"
[preflight]
enabled = false
[server]
listen = "127.0.0.1:8422"
TOML
export LIBREYOLO_AGENT_STATE_DIR=/tmp/rj/state
# The python process itself in the background (not the shell function: kill -9 must hit the agent).
python3 -m agent.cli run /tmp/rj/job.toml > /tmp/rj/agent1.log 2>&1 &
a1=$!
for _ in $(seq 1 120); do
  e=$(agent status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2>/dev/null)
  [ "${e:-0}" -ge 3 ] && break; sleep 0.5
done
kill -9 $a1; wait $a1 2>/dev/null
echo "agent SIGKILLed at epoch $e; trainer processes now:" >> "$OUT/reattach.txt"
ps -eo pid,ppid,sid,cmd | grep '[l]ibreyolo train' >> "$OUT/reattach.txt"
agent run /tmp/rj/job.toml > /tmp/rj/agent2.log 2>&1; echo "second agent exit $?" >> "$OUT/reattach.txt"
grep -vE "uploaded\+verified" /tmp/rj/agent2.log | tail -40 >> "$OUT/reattach.txt"
echo "trainers started across both agents: $(grep -c 'trainer started' /tmp/rj/agent1.log /tmp/rj/agent2.log | paste -sd' ')" >> "$OUT/reattach.txt"
sleep 1; echo "GPU processes after:" >> "$OUT/reattach.txt"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$OUT/reattach.txt"
ls /tmp/rj/synced/weights >> "$OUT/reattach.txt"
