#!/usr/bin/env bash
# The first real box on a GPU machine (docs/gpu-validation.md section 10): the README's on-start
# line exactly as written, on an image whose python3 is a venv holding CUDA torch, no systemd, no
# package index (PIP_NO_INDEX=1, every missing package from a local wheel folder), a dataset on a
# (fake) Hugging Face Hub and a (fake) vast.ai on 127.0.0.1 (scripts/gpu_issue15.py serve).
#
#   REPO_URL=<git URL or bundle of this project> scripts/gpu-firstbox.sh [boot|guard|all]
#
# boot:  the start line from a bare box to the first epoch (timed), the same line again as a
#        second boot would run it (a no-op), then the job to its end (teardown confirmed).
# guard: the agent SIGKILLed mid-run and not restarted; the guard, at the hard deadline, stops
#        the trainer, saves the newest last.pt (read back) and stops the box: the times of each.
# Results go to $OUT (default ./gpu-out).
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
REPO_URL="${REPO_URL:?set REPO_URL to a git URL or bundle of this project}"
only="${1:-all}"
here="$PWD"
B=/tmp/firstbox; rm -rf "$B"; mkdir -p "$B/wheels"
R="$OUT/firstbox.txt"; : > "$R"
say() { echo "[$(date +%H:%M:%S.%N | cut -c1-12)] $*" | tee -a "$R"; }
now() { date +%s.%N; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }

# ---- the wheel folder: what the image lacks (.whl/, carried), plus one stand-in. libreyolo
# requires opencv-python; the image holds opencv-python-headless (the same cv2). The real wheel
# (79 MB) is over the device tool's 64 MiB carry limit and this box reaches no index, so a
# metadata-only opencv-python of the headless version stands for it: cv2 is the image's.
cp .whl/*.whl "$B/wheels/" 2>/dev/null
python3 - "$B/wheels" <<'PY' | tee -a "$R"
import base64, hashlib, importlib.metadata as md, sys, zipfile
try:
    md.version("opencv-python")
    print("opencv-python is in the image: no stand-in")
    raise SystemExit
except md.PackageNotFoundError:
    pass
ver = md.version("opencv-python-headless")
name = f"opencv_python-{ver}.dist-info"
files = {
    f"{name}/METADATA": f"Metadata-Version: 2.1\nName: opencv-python\nVersion: {ver}\nSummary: stand-in: cv2 is the image's opencv-python-headless\n",
    f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu-firstbox\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
def rec(data):
    d = base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()).rstrip(b"=").decode()
    return f"sha256={d},{len(data.encode())}"
record = "".join(f"{p},{rec(t)}\n" for p, t in files.items()) + f"{name}/RECORD,,\n"
path = f"{sys.argv[1]}/opencv_python-{ver}-py3-none-any.whl"
with zipfile.ZipFile(path, "w") as z:
    for p, t in files.items():
        z.writestr(p, t)
    z.writestr(f"{name}/RECORD", record)
print(f"stand-in opencv-python {ver} (cv2 from the image's opencv-python-headless {ver})")
PY

{
  echo "== machine"; nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
  echo "python3: $(command -v python3) ($(python3 -c 'import sys; print(sys.version.split()[0], "venv" if sys.prefix != sys.base_prefix else "system")'))"
  python3 -c 'import importlib.metadata as m; print("image torch", m.version("torch"), "torchvision", m.version("torchvision"))'
  echo "systemd as PID 1: $([ -d /run/systemd/system ] && echo yes || echo no)"
  echo "wheels: $(ls "$B/wheels" | tr '\n' ' ')"
} 2>&1 | tee -a "$R"

# ---- the fakes (from this checkout, with the image's python3)
python3 scripts/gpu_issue15.py serve "$B/serve" > "$B/serve.log" 2>&1 & serve_pid=$!
cleanup() {
  kill -TERM "$serve_pid" 2>/dev/null
  [ "$only" = guard ] || pkill -f 'libreyolo-agent supervise' 2>/dev/null
  python3 scripts/gpu_issue15.py cleanup /var/lib/libreyolo-agent "$B"/*/state 2>/dev/null
  cp "$B"/serve/vast.json "$OUT/vast.json" 2>/dev/null
}
trap cleanup EXIT
for _ in $(seq 1 150); do [ -s "$B/serve/serve.env" ] && break; sleep 0.2; done
[ -s "$B/serve/serve.env" ] || { cat "$B/serve.log" | tee -a "$R"; exit 1; }
# shellcheck disable=SC1091
. "$B/serve/serve.env"

job_toml() { # $1 name, $2 epochs, $3 extra [limits] lines, $4 runs dir
cat <<TOML
[job]
name = "$1"
runs_dir = "$4"
[train]
model = "${MODEL:-yolox-n}"
pretrained = false
epochs = $2
imgsz = 320
batch = 16
workers = 2
device = "0"
[dataset]
repo = "$DATA_REPO"
file = "$DATA_FILE"
data_yaml = "boxes/data.yaml"
[sync]
target = "hf://gpu-firstbox/$1"
every_epochs = 1
[teardown]
provider = "vast"
api_url = "$VAST_URL"
[limits]
$3
TOML
}

export PIP_NO_INDEX=1 PIP_FIND_LINKS="$B/wheels" HF_ENDPOINT HF_TOKEN VAST_API_KEY
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost HF_HUB_DISABLE_TELEMETRY=1

if [ "$only" = all ] || [ "$only" = boot ]; then
  # The start line as the README writes it, LIBREYOLO_AGENT_REPO (or <this repo>) = REPO_URL.
  line="$(grep -m1 -E '^(R=|\[ -d|git clone).*scripts/bootstrap\.sh' "$here/README.md")"
  line="${line//<this repo>/$REPO_URL}"
  export LIBREYOLO_AGENT_REPO="$REPO_URL"
  say "== boot: the README's start line: $line"
  export CONTAINER_ID=1501
  LIBREYOLO_AGENT_JOB_TOML="$(job_toml firstbox 6 'max_runtime = "30m"' /root/runs)"
  export LIBREYOLO_AGENT_JOB_TOML
  rm -rf /opt/libreyolo-agent /etc/libreyolo-agent /var/lib/libreyolo-agent
  t0=$(now)
  (cd / && bash -c "$line") > "$OUT/boot1.log" 2>&1; rc=$?
  t1=$(now)
  say "first boot: the start line exited $rc after $(secs "$t0" "$t1") s (log boot1.log)"
  grep -E '^==>|torch|bootstrap:' "$OUT/boot1.log" | cut -c1-200 | tee -a "$R"
  agent=/opt/libreyolo-agent/.venv/bin/libreyolo-agent
  first=""
  for _ in $(seq 1 1200); do
    e="$($agent status --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("epoch") or 0)' 2>/dev/null)"
    if [ "${e:-0}" -ge 1 ]; then first=$(now); break; fi
    sleep 0.25
  done
  if [ -n "$first" ]; then
    say "first epoch done $(secs "$t0" "$first") s after the start line began"
  else
    say "no first epoch within 300 s"; tail -40 /var/lib/libreyolo-agent/supervisor.log 2>/dev/null | tee -a "$R"
  fi
  # The second boot: the same line again (on Vast and RunPod the on-start hook runs every start).
  t2=$(now)
  (cd / && bash -c "$line") > "$OUT/boot2.log" 2>&1; rc=$?
  say "second run of the start line: exit $rc after $(secs "$t2" "$(now)") s (log boot2.log)"
  grep -E 'bootstrap:|already|nothing' "$OUT/boot2.log" | cut -c1-200 | tee -a "$R"
  say "supervisors running: $(pgrep -fc 'libreyolo-agent supervise')"
  for _ in $(seq 1 1200); do
    ph="$($agent status --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["phase"])' 2>/dev/null)"
    [ "$ph" = DONE ] && break
    pgrep -f 'libreyolo-agent supervise' >/dev/null || break
    sleep 0.5
  done
  $agent status 2>&1 | head -30 | tee -a "$R"
  python3 - "$B/serve/vast.json" <<'PY' | tee -a "$R"
import json, sys
d = json.load(open(sys.argv[1]))
calls = [f"{c['method']} {c['path']} -> {c['status']}" for c in d["requests"] if "1501" in c["path"]]
print("vast calls for 1501:", calls[-6:], "| state:", d["instances"]["1501"])
PY
  cp /var/lib/libreyolo-agent/agent.log "$OUT/boot-agent.log" 2>/dev/null
fi

if [ "$only" = all ] || [ "$only" = guard ]; then
  # The guard: the agent SIGKILLed after epoch 1 and not restarted; max_runtime 150 s with the
  # guard's margin 20 s and stale-after 10 s, so the hard deadline falls mid-training.
  G="$B/guard"; mkdir -p "$G"
  # A 5 s finish reserve: the estimated one (upload speed x checkpoint sizes) may exceed a
  # 150 s max_runtime, and the agent would then stop training at once (reason timeout).
  job_toml guardjob 200 "max_runtime = \"${GUARD_RUNTIME:-150s}\"
finish_reserve = \"5s\"" "$G/runs" > "$G/job.toml"
  agent=/opt/libreyolo-agent/.venv/bin/libreyolo-agent
  if [ ! -x "$agent" ]; then  # guard alone: the same install as the start line makes
    rm -rf /opt/libreyolo-agent && git clone -q "$REPO_URL" /opt/libreyolo-agent \
      && /opt/libreyolo-agent/install.sh > "$OUT/guard-install.log" 2>&1 || exit 1
  fi
  say "== guard: job with max_runtime ${GUARD_RUNTIME:-150s}, guard margin 20s, model ${MODEL:-yolox-n}"
  CONTAINER_ID=1502 LIBREYOLO_AGENT_STATE_DIR="$G/state" LIBREYOLO_AGENT_GUARD_MARGIN=20s \
    LIBREYOLO_AGENT_GUARD_STALE_AFTER=10s $agent run "$G/job.toml" > "$G/agent.out" 2>&1 & apid=$!
  for _ in $(seq 1 1200); do
    e="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("completed_epochs") or 0)' "$(ls -d "$G"/runs/*/status.json 2>/dev/null | head -1)" 2>/dev/null)"
    [ "${e:-0}" -ge 1 ] && break; sleep 0.25
  done
  kill -KILL "$apid"; tk=$(now)
  say "agent SIGKILLed at epoch ${e:-?}"
  for _ in $(seq 1 1200); do
    python3 - "$B/serve/vast.json" <<'PY' && break
import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(0 if any("1502" in c["path"] and c["method"] in ("PUT", "DELETE") for c in d["requests"]) else 1)
PY
    sleep 0.5
  done
  say "provider called $(secs "$tk" "$(now)") s after the agent's kill"
  sleep 3
  grep -h -E 'guard' "$G"/state/guard.log 2>/dev/null | tail -30 | cut -c1-240 | tee -a "$R"
  python3 bench/guard_timing.py "$G/state" 2>&1 | tee -a "$R"
  python3 - "$G/runs" "$B/serve/serve.env" <<'PY' 2>&1 | tee -a "$R"
import glob, hashlib, json, os, sys, urllib.request
st = json.load(open(glob.glob(sys.argv[1] + "/*/status.json")[0]))
print("trainer's run at the guard's stop: completed_epochs", st.get("completed_epochs"), "state", st.get("state"))
PY
  cp "$G"/state/guard*.log "$OUT/" 2>/dev/null
  python3 - "$B/serve/vast.json" <<'PY' | tee -a "$R"
import json, sys
d = json.load(open(sys.argv[1]))
calls = [f"{c['method']} {c['path']} -> {c['status']} at {c['at']}" for c in d["requests"] if "1502" in c["path"]]
print("vast calls for 1502:", calls[-6:], "| state:", d["instances"]["1502"])
PY
  say "trainer processes left: $(pgrep -fc 'libreyolo train|train_entry|warm_entry' || true)"
  cp "$G"/state/trainer.log "$OUT/guard-trainer.log" 2>/dev/null
  cp "$G"/state/agent.log "$OUT/guard-agent.log" 2>/dev/null
  cat "$G"/runs/*/status.json > "$OUT/guard-status.json" 2>/dev/null
fi
cat "$R" > /dev/null
