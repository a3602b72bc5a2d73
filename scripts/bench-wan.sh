#!/usr/bin/env bash
# IOTA training over shaped links: how much a miner's bandwidth costs the run's throughput.
#
# Every miner is its own `iota miner` process in its own network namespace (iota-wan-m0, …),
# joined to the host by a veth pair; the chain (`iota localnet chain`), the orchestrator (with a
# directory store, so every tensor crosses the miner's link) and PostgreSQL run on the host. Both
# directions of each veth are shaped with a token bucket (`tc … tbf`): the host end shapes the
# miner's download, the namespace end its upload. Only the bandwidth is limited: tbf adds no
# propagation delay (the links' round trip stays under a millisecond plus queueing).
#
# One run, one set of processes: epoch 0 (miners joining, unshaped) is a warm-up, then the link
# changes at every epoch boundary, cycling through unshaped, RATES (100mbit 20mbit) for ROUNDS
# rounds, every other round in reverse order (ABC CBA …), so that both sides see the same machine
# and any drift evens out. For each epoch it reports the wall time from the orchestrator's phase
# timestamps (training, uploading, merging), tokens/s (tokens of completed samples over the
# epoch's wall time), and per miner: compute, hop I/O (handling hops less compute: the activation
# and gradient traffic and its requests), and the all-reduce (epoch-start weight load,
# pseudo-gradient upload, merges) from the miners' Prometheus counters, and the bytes that crossed
# its link (veth counters). Then tokens/s of each link against the unshaped epochs of the run
# (goal, issue 55: at least 0.90 at 100 Mbit/s). Prints a Markdown section on stdout, progress on
# stderr.
#
#   sudo scripts/bench-wan.sh                       # small, 3 stages x 2 miners, 2 rounds
#   MODEL=tiny SAMPLES=48 sudo scripts/bench-wan.sh
#   ROUNDS=1 RATES="100mbit" sudo scripts/bench-wan.sh
#   ORCHESTRATOR_ARGS="--wire int4" sudo scripts/bench-wan.sh   # further run options
#
# Needs root (namespaces, veth, tc), iproute2, curl, jq, python3 and PostgreSQL's binaries
# (scripts/pg.sh; or DATABASE_URL to a server where this user may create databases). Builds
# `iota` in release mode unless IOTA_BIN names one. Everything it creates (namespaces, veth
# pairs, the interface the host services listen on, processes, the database, its
# temporary directory) is removed when it ends, also on failure or Ctrl-C; KEEP=1 keeps the
# logs and counters (they are kept anyway when it fails; the store's tensors never are). A run
# of the defaults takes about 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

# `scripts/bench-wan.sh sparse`: the same run with compressed pseudo-gradients (top-128 of every
# 4096 values, merged updates of the top 512, the outer step without momentum), unshaped
# against 100 Mbit/s.
if [ "${1:-}" = sparse ]; then
    ORCHESTRATOR_ARGS="${ORCHESTRATOR_ARGS:---pseudo-gradients top-128/4096 --merged-top 512 --outer-lr 1}"
    OUTER_MOMENTUM="${OUTER_MOMENTUM:-0}"
    RATES="${RATES:-100mbit}"
fi
MODEL="${MODEL:-small}"
OUTER_MOMENTUM="${OUTER_MOMENTUM:-0.5}"
MINERS_PER_STAGE="${MINERS_PER_STAGE:-2}"
ROUNDS="${ROUNDS:-2}"
RATES="${RATES:-100mbit 20mbit}"
SAMPLES="${SAMPLES:-24}"
MICRO_BATCH="${MICRO_BATCH:-4}"
SEQ_LEN="${SEQ_LEN:-64}"
PARTITIONS="${PARTITIONS:-4}"
# Six miners share this machine's cores: one thread per tensor operation each.
MINER_THREADS="${MINER_THREADS:-1}"
# Further `iota orchestrator` flags (split on spaces), e.g. another wire encoding.
read -r -a orchestrator_args <<<"${ORCHESTRATOR_ARGS:-}"
# Longest wait for one epoch before giving up (a phase that ends by deadline takes longer).
EPOCH_TIMEOUT_S="${EPOCH_TIMEOUT_S:-900}"
# 10.$NET.0.1 is the host services' address, 10.$NET.$((k+1)).0/30 miner k's link.
NET="${NET:-213}"
NS_PREFIX="iota-wan-m"

die() { echo "bench-wan: $*" >&2; exit 1; }
log() { echo "bench-wan: $*" >&2; }

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, veth pairs, tc)"
for tool in ip tc curl jq python3 psql; do
    command -v "$tool" >/dev/null || die "needs $tool"
done
read -r -a rates <<<"$RATES"
variants=(unshaped "${rates[@]}")
for r in "${rates[@]}"; do
    [[ "$r" =~ ^[0-9]+(k|m|g)bit$ ]] || die "RATES: '$r' is not a tc rate like 100mbit"
done

# --- what this run created, for the cleanup -------------------------------------------------
tmp=""
pids=()
names=()
namespaces=()
host_if=""
pg_dir=""
db_name=""
admin_url=""
failed=1

cleanup() {
    local rc=$?
    set +e
    # In the reverse order of starting: the miners (while the orchestrator they report to is
    # still up), then the orchestrator, then the chain; each asked to stop and killed if it has
    # not within 15 s.
    local i pid
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        pid=${pids[$i]}
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 150); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "${names[$i]} (pid $pid) did not stop; killing it"
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
    done
    # Deleting a namespace deletes the veth end inside it, and with it the host end.
    for ns in "${namespaces[@]}"; do
        ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
    done
    [ -n "$host_if" ] && ip link del "$host_if" 2>/dev/null
    if [ -n "$db_name" ] && [ -z "$pg_dir" ]; then
        psql -q "$admin_url" -c "DROP DATABASE IF EXISTS $db_name" >/dev/null 2>&1 \
            || log "could not drop database $db_name"
    fi
    [ -n "$pg_dir" ] && scripts/pg.sh stop "$pg_dir"
    if [ -n "$tmp" ]; then
        if [ "$failed" = 1 ] || [ "${KEEP:-0}" = 1 ]; then
            # The logs and counters, not the gigabyte or two of tensors in the store.
            rm -rf "$tmp/store"
            log "logs kept in $tmp"
        else
            rm -rf "$tmp"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Refuse to touch what is not ours: leftovers of another run, or an address range in use.
for ns in $(ip netns list | awk '{print $1}'); do
    [[ "$ns" == "$NS_PREFIX"* ]] && die "namespace $ns exists (another run, or a leftover: ip netns del $ns)"
done
if ip link show iwan-host >/dev/null 2>&1; then
    die "interface iwan-host exists (another run, or a leftover: ip link del iwan-host)"
fi
if ip -4 addr show | grep -q "inet 10\.$NET\."; then
    die "10.$NET.0.0/16 is in use on this host; pick another NET"
fi

if [ -n "${IOTA_BIN:-}" ]; then
    iota="$IOTA_BIN"
else
    log "building iota (release)"
    cargo build -q --release -p iota-cli
    iota="$PWD/target/release/iota"
fi
[ -x "$iota" ] || die "no iota binary at $iota"

tmp="$(mktemp -d /tmp/iota-wan.XXXXXX)"
chmod 755 "$tmp"
mkdir -p "$tmp/logs" "$tmp/bounds"
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
started_at=$(date +%s)
log "load average before: $load_before; logs in $tmp/logs"

# start NAME CMD…: runs a service in the background, output to its log, remembered for cleanup.
start() {
    local name=$1
    shift
    "$@" >"$tmp/logs/$name.log" 2>&1 &
    pids+=($!)
    names+=("$name")
}

alive_or_die() {
    local i
    for i in "${!pids[@]}"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            log "${names[$i]} exited; the end of its log:"
            tail -n 20 "$tmp/logs/${names[$i]}.log" >&2
            die "${names[$i]} stopped unexpectedly"
        fi
    done
}

# wait_for WHAT SECONDS CMD…: until CMD succeeds, or fail.
wait_for() {
    local what=$1 secs=$2
    shift 2
    local deadline=$(($(date +%s) + secs))
    until "$@" >/dev/null 2>&1; do
        alive_or_die
        [ "$(date +%s)" -lt "$deadline" ] || die "timed out after ${secs}s waiting for $what"
        sleep 0.2
    done
}

# --- the host side: one address for every service, on an interface of our own (a bridge with
# no ports: the `dummy` module is not everywhere) ---------------------------------------------
host_ip="10.$NET.0.1"
ip link add iwan-host type bridge
host_if=iwan-host
ip addr add "$host_ip/32" dev "$host_if"
ip link set "$host_if" up
free_port() {
    python3 -c 'import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])' "$host_ip"
}

if [ -z "${DATABASE_URL:-}" ]; then
    pg_env="$(scripts/pg.sh start)"
    eval "$pg_env"
    pg_dir="$IOTA_PG_DIR"
fi
admin_url="$DATABASE_URL"
db_name="iota_wan_$$"
psql -q "$admin_url" -c "CREATE DATABASE $db_name" >/dev/null
db_url="${admin_url%/*}/$db_name"

chain_port=$(free_port)
chain_url="ws://$host_ip:$chain_port"
start chain "$iota" localnet chain --host "$host_ip" --port "$chain_port" --block-time 250ms
wait_for "the chain" 60 grep -q "localnet ready" "$tmp/logs/chain.log"

# --- wallets and the subnet, as `iota localnet up` sets them up, from the command line --------
wallets="$tmp/wallets"
w=(--wallet.path "$wallets" --wallet.name alice)
chain_cli=("$iota" chain --yes --subtensor.chain_endpoint "$chain_url")
# Alice, the localnet's funded dev account, owns the subnet and pays every registration.
"$iota" wallet regen-coldkey "${w[@]}" --no-password \
    --seed 0xe5be9a5092b81bca64be81d212e7f2f9eba183bb7a90954f7b76361f6edb5c0a >>"$tmp/logs/setup.log" 2>&1
# `small` has stages [2, 4, 2] and `tiny` [1, 1, 1]; a model file names its own.
case "$MODEL" in
    small | tiny) stages=3 ;;
    *) stages=$(jq -e '.stages | length' "$MODEL") || die "MODEL: $MODEL is not a model config file" ;;
esac
miners=$((stages * MINERS_PER_STAGE))
for name in owner $(seq -f 'm%g' 0 $((miners - 1))); do
    "$iota" wallet new-hotkey "${w[@]}" --wallet.hotkey "$name" >>"$tmp/logs/setup.log" 2>&1
done
"${chain_cli[@]}" register-subnet "${w[@]}" --wallet.hotkey owner >"$tmp/logs/subnet.log" 2>&1
netuid=$(sed -nE 's/^registered subnet ([0-9]+) .*/\1/p' "$tmp/logs/subnet.log")
[ -n "$netuid" ] || die "register-subnet printed no netuid (see $tmp/logs/subnet.log)"
"${chain_cli[@]}" start-call "${w[@]}" --netuid "$netuid" >>"$tmp/logs/setup.log" 2>&1
# Registered from the host one after another: they all burn from Alice's coldkey, whose nonce
# concurrent registrations from the namespaces would race for.
for k in $(seq 0 $((miners - 1))); do
    "${chain_cli[@]}" register "${w[@]}" --wallet.hotkey "m$k" --netuid "$netuid" \
        >>"$tmp/logs/setup.log" 2>&1
done
log "subnet $netuid with $miners miner hotkeys registered"

orch_port=$(free_port)
base="http://$host_ip:$orch_port"
# Phase deadlines far beyond what a phase needs at 20 Mbit/s: every phase should end by quorum,
# so the epoch's time is the work's, not a deadline's (the report flags one that did not).
training_s=900 uploading_s=600 merging_s=600
start orchestrator "$iota" orchestrator --model "$MODEL" --listen "$host_ip:$orch_port" \
    --database-url "$db_url" --store "$tmp/store" \
    --subtensor.chain_endpoint "$chain_url" --netuid "$netuid" \
    "${w[@]}" --wallet.hotkey owner --run-name wan \
    --samples-per-epoch "$SAMPLES" --micro-batch "$MICRO_BATCH" --seq-len "$SEQ_LEN" \
    --partitions "$PARTITIONS" --max-in-flight 4 \
    --training-s "$training_s" --uploading-s "$uploading_s" --merging-s "$merging_s" \
    --merge-round-s 300 --lease-s 120 --heartbeat-timeout-s 120 --retention-epochs 2 \
    --init-seed 7 --inner-lr 3e-3 --outer-momentum "$OUTER_MOMENTUM" \
    --metagraph-refresh-s 1 --tick-ms 100 --rate-per-hotkey 1000 --rate-per-ip 1000 \
    "${orchestrator_args[@]}"
wait_for "the orchestrator" 120 curl -sf --max-time 2 "$base/v1/status"

# --- one namespace and link per miner --------------------------------------------------------
host_dev() { echo "iwan$1-h"; }
ns_dev() { echo "iwan$1-n"; }
ns_of() { echo "$NS_PREFIX$1"; }
miner_ip() { echo "10.$NET.$(($1 + 1)).2"; }
for k in $(seq 0 $((miners - 1))); do
    ns=$(ns_of "$k")
    ip netns add "$ns"
    namespaces+=("$ns")
    ip link add "$(host_dev "$k")" type veth peer name "$(ns_dev "$k")"
    ip link set "$(ns_dev "$k")" netns "$ns"
    ip addr add "10.$NET.$((k + 1)).1/30" dev "$(host_dev "$k")"
    ip link set "$(host_dev "$k")" up
    ip -n "$ns" addr add "$(miner_ip "$k")/30" dev "$(ns_dev "$k")"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$(ns_dev "$k")" up
    # The host's services are reachable through the link and nothing else is.
    ip -n "$ns" route add "$host_ip/32" via "10.$NET.$((k + 1)).1"
done

# shape RATE: every link in both directions (`unshaped`: no qdisc at all).
shape() {
    local rate=$1 k burst
    if [ "$rate" != unshaped ]; then
        # About 5 ms at the rate, at least a few full-size packets.
        burst=$(python3 -c 'import re,sys; n,u=re.match(r"(\d+)(k|m|g)bit",sys.argv[1]).groups(); print(max(15000, int(n)*{"k":1e3,"m":1e6,"g":1e9}[u]//8*5//1000))' "$rate")
    fi
    for k in $(seq 0 $((miners - 1))); do
        if [ "$rate" = unshaped ]; then
            tc qdisc del dev "$(host_dev "$k")" root 2>/dev/null || true
            tc -n "$(ns_of "$k")" qdisc del dev "$(ns_dev "$k")" root 2>/dev/null || true
        else
            tc qdisc replace dev "$(host_dev "$k")" root tbf rate "$rate" burst "$burst" latency 50ms
            tc -n "$(ns_of "$k")" qdisc replace dev "$(ns_dev "$k")" root tbf rate "$rate" burst "$burst" latency 50ms
        fi
    done
}

# The miners join one at a time, each given its stage before the next starts (as in `localnet
# up`), so that the stages fill round robin.
joined() { [ "$(curl -sf --max-time 2 "$base/v1/miners?status=active" | jq length)" -ge "$1" ]; }
for k in $(seq 0 $((miners - 1))); do
    start "m$k" ip netns exec "$(ns_of "$k")" env IOTA_CPU_THREADS="$MINER_THREADS" RUST_LOG=info \
        "$iota" miner "${w[@]}" --wallet.hotkey "m$k" \
        --subtensor.chain_endpoint "$chain_url" --netuid "$netuid" --orchestrator.url "$base" \
        --progress log --poll-interval-ms 50 --memory-gb 4 --metrics.addr "$(miner_ip "$k"):9100"
    wait_for "miner m$k to join" 300 joined $((k + 1))
    log "miner m$k joined ($((k + 1))/$miners)"
done

# --- the epochs ------------------------------------------------------------------------------
# While a stage has no miner, an epoch ends as soon as it starts (its samples have nowhere to
# go), so the run is many epochs on when the last miner joins: that epoch, e0, is the warm-up,
# and e0+1 .. e0+ROUNDS*links are measured.
nv=${#variants[@]}
last=$((ROUNDS * nv))
# The link of measured epoch e0+E (E in 1..last): rounds alternate the order.
variant_of() {
    local e=$1 r i
    r=$(((e - 1) / nv))
    i=$(((e - 1) % nv))
    ((r % 2 == 1)) && i=$((nv - 1 - i))
    echo "${variants[$i]}"
}
# boundary E: the counters as epoch E starts (the end of epoch E-1): each link's bytes (host
# side: rx is the miner's upload, tx its download) and each miner's metrics.
boundary() {
    local e=$1 k
    {
        echo "time $(date +%s.%N)"
        for k in $(seq 0 $((miners - 1))); do
            echo "link m$k $(cat "/sys/class/net/$(host_dev "$k")/statistics/rx_bytes") $(cat "/sys/class/net/$(host_dev "$k")/statistics/tx_bytes")"
        done
    } >"$tmp/bounds/$e.txt"
    local scrapes=()
    for k in $(seq 0 $((miners - 1))); do
        curl -sf --max-time 5 "http://$(miner_ip "$k"):9100/metrics" >"$tmp/bounds/$e.m$k.prom" &
        scrapes+=($!)
    done
    # A failed scrape leaves an empty file: that miner's counters read as missing.
    for k in "${scrapes[@]}"; do wait "$k" || log "epoch $e: a metrics scrape failed"; done
}

epoch_now() { curl -sf --max-time 2 "$base/v1/status" | jq -e '.epoch'; }
e0=$(epoch_now) || die "no status from the orchestrator"
cur=$e0
echo "warm-up" >"$tmp/bounds/variant.$cur"
log "epoch $cur: warm-up (unshaped); then $last measured epochs: $(for e in $(seq 1 "$last"); do printf '%s ' "$(variant_of "$e")"; done)"
deadline=$(($(date +%s) + EPOCH_TIMEOUT_S))
while :; do
    e=$(epoch_now) || e=$cur
    if [ "$e" -gt "$cur" ]; then
        [ "$e" -eq $((cur + 1)) ] || log "warning: epoch $cur to $e between two polls"
        boundary "$e"
        if [ "$e" -le $((e0 + last)) ]; then
            v=$(variant_of $((e - e0)))
            shape "$v"
            echo "$v" >"$tmp/bounds/variant.$e"
        else
            shape unshaped
        fi
        log "epoch $cur ended after $(($(date +%s) + EPOCH_TIMEOUT_S - deadline)) s; epoch $e: $(cat "$tmp/bounds/variant.$e" 2>/dev/null || echo end)"
        cur=$e
        [ "$e" -gt $((e0 + last)) ] && break
        deadline=$(($(date +%s) + EPOCH_TIMEOUT_S))
    fi
    alive_or_die
    [ "$(date +%s)" -lt "$deadline" ] || die "epoch $cur did not end within ${EPOCH_TIMEOUT_S}s"
    sleep 0.2
done

curl -sf "$base/v1/throughput?limit=1000" >"$tmp/throughput.json"
curl -sf "$base/v1/miners" >"$tmp/miners.json"
psql -At -F, "$db_url" -c "SELECT epoch, extract(epoch FROM started_at), extract(epoch FROM training_ended_at), extract(epoch FROM uploading_ended_at), extract(epoch FROM ended_at), samples_completed, samples_abandoned FROM epochs ORDER BY epoch" >"$tmp/epochs.csv"
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
took=$(($(date +%s) - started_at))
log "load average after: $load_after; $took s"
for k in $(seq 0 $((miners - 1))); do
    sed -nE 's/.*miner (5[1-9A-HJ-NP-Za-km-z]+) \(uid.*/m'"$k"' \1/p' "$tmp/logs/m$k.log" | head -n 1
done >"$tmp/hotkeys.txt"

commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+uncommitted')"
BW_MODEL="$MODEL" BW_STAGES="$stages" BW_MPS="$MINERS_PER_STAGE" BW_SAMPLES="$SAMPLES" \
BW_MB="$MICRO_BATCH" BW_SEQ="$SEQ_LEN" BW_PARTS="$PARTITIONS" BW_THREADS="$MINER_THREADS" \
BW_DEADLINES="$training_s $uploading_s $merging_s" BW_VARIANTS="${variants[*]}" \
BW_EXTRA="${orchestrator_args[*]}" BW_LOAD_BEFORE="$load_before" BW_LOAD_AFTER="$load_after" BW_TOOK="$took" BW_COMMIT="$commit" \
    python3 - "$tmp" "$e0" "$last" "$miners" <<'PY'
import json, os, re, statistics, sys, time
tmp, e0, last, miners = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
env = os.environ
model, stages, mps = env["BW_MODEL"], int(env["BW_STAGES"]), int(env["BW_MPS"])
samples, mb, seq, parts = (int(env[k]) for k in ("BW_SAMPLES", "BW_MB", "BW_SEQ", "BW_PARTS"))
deadlines = dict(zip(["training", "uploading", "merging"], map(float, env["BW_DEADLINES"].split())))
variants = env["BW_VARIANTS"].split()

def prom(path):
    out = {}
    try:
        text = open(path).read()
    except OSError:
        return out
    for line in text.splitlines():
        m = re.match(r'^(iota_miner_[a-z_]+)(\{[^}]*\})?\s+([0-9.e+-]+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out

def bound(e):
    d = {"links": {}, "metrics": {}}
    for line in open(os.path.join(tmp, "bounds", f"{e}.txt")):
        f = line.split()
        if f[0] == "time":
            d["time"] = float(f[1])
        elif f[0] == "link":
            d["links"][f[1]] = (int(f[2]), int(f[3]))
    for k in range(miners):
        d["metrics"][f"m{k}"] = prom(os.path.join(tmp, "bounds", f"{e}.m{k}.prom"))
    return d

epochs = {}
for line in open(os.path.join(tmp, "epochs.csv")):
    f = line.strip().split(",")
    if len(f) < 7:
        continue
    epochs[int(f[0])] = dict(zip(["start", "train_end", "upload_end", "end"],
                                 [float(x) if x else None for x in f[1:5]]),
                             completed=int(f[5]), abandoned=int(f[6]))
tp = {t["epoch"]: t for t in json.load(open(os.path.join(tmp, "throughput.json")))}
hot = dict(line.split() for line in open(os.path.join(tmp, "hotkeys.txt")) if line.strip())
mj = json.load(open(os.path.join(tmp, "miners.json")))
mlist = mj if isinstance(mj, list) else mj.get("miners", [])
stage_of = {m["hotkey"]: m.get("stage") for m in mlist}

rows = []
for e in range(e0 + 1, e0 + last + 1):
    ep, b0, b1 = epochs[e], bound(e), bound(e + 1)
    variant = open(os.path.join(tmp, "bounds", f"variant.{e}")).read().strip()
    wall = ep["end"] - ep["start"]
    phases = {"training": ep["train_end"] - ep["start"],
              "uploading": ep["upload_end"] - ep["train_end"],
              "merging": ep["end"] - ep["upload_end"]}
    tokens = tp.get(e, {}).get("tokens", ep["completed"] * mb * seq)
    per = []
    for k in range(miners):
        m0, m1 = b0["metrics"][f"m{k}"], b1["metrics"][f"m{k}"]
        d = lambda name: (m1.get(name, 0.0) - m0.get(name, 0.0)) / 1e3
        busy, compute = d("iota_miner_busy_ms_total"), d("iota_miner_compute_ms_total")
        ar = {s: d(f'iota_miner_all_reduce_ms_total{{step="{s}"}}') for s in ("load", "upload", "merge")}
        up = b1["links"][f"m{k}"][0] - b0["links"][f"m{k}"][0]
        down = b1["links"][f"m{k}"][1] - b0["links"][f"m{k}"][1]
        lost = m1.get("iota_miner_leases_lost_total", 0) - m0.get("iota_miner_leases_lost_total", 0)
        per.append(dict(busy=busy, compute=compute, io=busy - compute, ar=ar, name=f"m{k}",
                        ar_total=sum(ar.values()), up=up, down=down, lost=lost))
    mean = lambda key: statistics.mean(p[key] for p in per)
    notes = [f"{p} phase hit its deadline" for p, s in phases.items() if s >= 0.98 * deadlines[p]]
    lost = sum(p["lost"] for p in per)
    if lost:
        notes.append(f"{lost:.0f} leases lost")
    if ep["abandoned"]:
        notes.append(f"{ep['abandoned']} samples abandoned")
    rows.append(dict(e=e, variant=variant, wall=wall, phases=phases, tokens=tokens,
                     tps=tokens / wall, train_tps=tokens / phases["training"],
                     compute=mean("compute"), io=mean("io"),
                     ar={s: statistics.mean(p["ar"][s] for p in per) for s in ("load", "upload", "merge")},
                     ar_total=mean("ar_total"), ar_max=max(p["ar_total"] for p in per),
                     up=mean("up") / 1e6, down=mean("down") / 1e6,
                     maxdown=max(p["down"] for p in per) / 1e6, notes=notes))

print(f"Model `{model}`, {stages} stages x {mps} miners, each miner an `iota miner` process in its own network "
      f"namespace with {env['BW_THREADS']} CPU thread(s), behind a veth pair shaped both ways by `tc tbf` "
      f"(bandwidth only: no added delay); orchestrator (directory store: every tensor crosses the miner's link), "
      f"chain and PostgreSQL on the host. {samples} samples of {mb}x{seq} tokens an epoch, "
      f"int8 boundary tensors unless the flags say otherwise, {parts} partitions a stage{', orchestrator flags ' + repr(env['BW_EXTRA']) if env['BW_EXTRA'] else ''}. Epoch {e0}, in which the last miner joined, is a warm-up; then the link "
      f"changes at each epoch boundary, rounds in alternating order. At `{env['BW_COMMIT']}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
      f"load average before: {env['BW_LOAD_BEFORE']}, after: {env['BW_LOAD_AFTER']}; {env['BW_TOOK']} s in all.")
print()
print("Per epoch. *compute*, *hop I/O* (handling hops less compute: boundary tensors down and up, the requests) and "
      "*all-reduce* (epoch-start weights load + pseudo-gradient upload + merges, each with its own compute) are "
      "seconds per miner, mean over the miners, from their counters; MB are per miner over its link (veth counters, "
      "the slowest miner's all-reduce and the largest download in brackets: the merging phase waits for the miner "
      "with the most partitions to merge).")
print()
print("| epoch | link | wall s | training s | uploading s | merging s | tokens/s | compute s | hop I/O s | all-reduce s: load+upload+merge (max) | MB down (max) / up | notes |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
for r in rows:
    p, a = r["phases"], r["ar"]
    print(f"| {r['e']} | {r['variant']} | {r['wall']:.1f} | {p['training']:.1f} | {p['uploading']:.1f} | {p['merging']:.1f} | "
          f"{r['tps']:.0f} | {r['compute']:.1f} | {r['io']:.1f} | {r['ar_total']:.1f}: {a['load']:.1f}+{a['upload']:.1f}+{a['merge']:.1f} ({r['ar_max']:.1f}) | "
          f"{r['down']:.1f} ({r['maxdown']:.1f}) / {r['up']:.1f} | {'; '.join(r['notes'])} |")
print()
base = [r for r in rows if r["variant"] == "unshaped"]
bt = statistics.mean(r["tps"] for r in base)
bw = statistics.mean(r["wall"] for r in base)
btt = statistics.mean(r["train_tps"] for r in base)
print("Per link, means over its epochs; *vs unshaped* is the ratio of mean tokens/s to the unshaped epochs' of this run "
      "(goal at 100 Mbit/s: at least 0.90); *per round* pairs each epoch with the unshaped epoch of its round. "
      "*Break-even* is the unshaped epoch length at which the link's extra seconds per epoch would cost exactly 10% "
      "(9 x extra), if that extra does not grow with the epoch (the all-reduce moves a fixed number of bytes an epoch).")
print()
print("| link | epochs | wall s | extra s / epoch | tokens/s | vs unshaped | per round | training-phase tokens/s vs unshaped | all-reduce s | MB down / up per miner | break-even epoch s |")
print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|")
for v in variants:
    rs = [r for r in rows if r["variant"] == v]
    if not rs:
        continue
    t = statistics.mean(r["tps"] for r in rs)
    w = statistics.mean(r["wall"] for r in rs)
    tt = statistics.mean(r["train_tps"] for r in rs)
    rounds = {}
    for r in rows:
        rounds.setdefault((r["e"] - e0 - 1) // len(variants), {})[r["variant"]] = r["tps"]
    pr = [rd[v] / rd["unshaped"] for rd in rounds.values() if v in rd and "unshaped" in rd]
    extra = w - bw
    print(f"| {v} | {len(rs)} | {w:.1f} | {extra:+.1f} | {t:.0f} | {t / bt:.3f} | {', '.join(f'{x:.3f}' for x in pr)} | "
          f"{tt / btt:.3f} | {statistics.mean(r['ar_total'] for r in rs):.1f} | "
          f"{statistics.mean(r['down'] for r in rs):.1f} / {statistics.mean(r['up'] for r in rs):.1f} | "
          f"{'-' if v == 'unshaped' or extra <= 0 else f'{9 * extra:.0f}'} |")
stages_line = ", ".join(f"{k}: stage {stage_of.get(hot.get(k), '?')}" for k in sorted(hot, key=lambda s: int(s[1:])))
print()
print(f"Miners' stages: {stages_line}.")
PY
failed=0
