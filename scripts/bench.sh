#!/usr/bin/env bash
# Runs every benchmark of the project, one after another on this machine, and writes
# BENCHMARKS.md: which machine, which commit, and each benchmark's own output. Every ratio in it
# is measured side by side within one benchmark (both sides in the same process, interleaved or
# before-and-after), never across separate runs.
#
#   scripts/bench.sh                       # all of them (about 30-60 minutes on 2 cores)
#   scripts/bench.sh clasp butterfly       # a subset, by name (see BENCHES below)
#   BENCH_OUT=/tmp/b.md scripts/bench.sh   # write elsewhere
#
# Each benchmark's section is kept under target/bench/ and stamped with its own commit and date;
# BENCHMARKS.md is assembled from all kept sections, so a subset run replaces only its own.
#
# Starts a throwaway PostgreSQL (scripts/pg.sh) unless DATABASE_URL is set. Benchmarks build in
# release mode into the usual target directory.
set -euo pipefail
cd "$(dirname "$0")/.."

# name | command | what it measures
BENCHES=(
  "model|cargo bench -p iota-model --bench model|Training core: per-stage and monolithic forward+backward tokens/s of \`small\`, and the bottleneck compression table"
  "data|cargo bench -p iota-model --bench data|Data: \`data prepare\` tokens/s and peak resident memory on over 100 MB of English (Debian's python3-doc sources, repeated), and the prepared-dataset loader's windows/s against a stage-0 miner's consumption"
  "memory|cargo bench -p iota-model --bench memory|Memory: peak resident memory of one training step (forward, backward, AdamW) of each \`iota-1.5b\` stage at 1x800 and 4x800 tokens on the CPU with per-block checkpointing, beside the equation of \`iota_model::memory\` (goal: at most 16 GB at 4x800)"
  "cpu-vs-torch|scripts/bench-cpu-vs-torch.sh|CPU training core against PyTorch: forward+backward tokens/s of the whole \`small\` model at 4x128 in f32, candle (its own gemm, with its AVX-512 kernels and, on an AVX-512 CPU, once more without them; with the \`openblas\` feature; and with each micro-batch cut in two runs trained side by side, \`--sub-batches 2\`) and PyTorch interleaved at 1 thread and at the machine's core count, median of 3 rounds (needs PyTorch: \`TORCH_PYTHON\`, see \`scripts/reference/README.md\`)"
  "overhead|cargo bench -p iota-miner --bench overhead|Miner overhead: a miner's tokens/s through the whole protocol against the training core alone"
  "pipeline|cargo bench -p iota-miner --bench pipeline|Pipeline against monolithic: end-to-end tokens/s of three miners against one process training the same model"
  "convergence|cargo bench -p iota-miner --bench convergence|Convergence at equal tokens: \`small\` on real English (Debian's python3-doc) trained by 3 stages x 2 miners (int8 wire, a merge every epoch) against one process with AdamW on the same samples in the same order; held-out loss of both after every epoch"
  "sparse|cargo bench -p iota-model --bench sparse|Compressed pseudo-gradients against dense ones at equal tokens: replicas of a small model trained DiLoCo-style in one process on the grammar corpus, 3 seeds, held-out loss after every epoch with dense merges and with sparse ones (top-128 of 4096, int8, error feedback with and without decay; merged updates of top-512, the union of four uploads), and the wire bytes of an upload and of a merged update"
  "sparse-text|env BENCH_CORPUS=text BENCH_VARIANTS=dense@1/0,4096:128:512:0.95+fb@1/0,4096:256:1024:0.95+fb@1/0,4096:512:2048:0.95+fb@1/0 cargo bench -p iota-model --bench sparse|The same on real English (Debian's python3-doc, a BPE tokenizer of 2048 tokens trained on it, 5% of documents held out), with the encoding sparse miners shipped when it was measured (top-128 of 4096, merged top-512, error feedback decaying by 0.95) and two denser ones (top-256 merged top-1024, top-512 merged top-2048), to show how the loss follows the density"
  "sparse-text-32|env RAYON_NUM_THREADS=1 BENCH_CORPUS=text BENCH_INNER_STEPS=32 BENCH_SEEDS=6 BENCH_VARIANTS=dense@1/0,4096:256:1024:0.7:4+fb@1/0 cargo bench -p iota-model --bench sparse|The same on real English with 32 inner steps an epoch, what each miner of a 4-miner stage takes under the orchestrator's defaults (256 samples an epoch, an inner step every 2), 6 seeds: dense against top-256 of 4096 with merged top-1024, 4-bit values and the error feedback a miner keeps (decaying by 0.7), an all-reduce of 0.15-0.18x of a stage's fp32 size (\`butterfly\`)"
  "sparse-codec|cargo bench -p iota-protocol --bench sparse_codec|Sparse wire format at real size: encoding and checked decoding of an \`iota-sparse/v3\` pseudo-gradient partition of 131,072,000 values (524 MB in fp32) in the encodings a run ships, one thread"
  "butterfly|cargo bench -p iota-miner --bench butterfly|Weight all-reduce: bytes per miner and time at 2, 4, 8 and 16 miners per stage, with dense and with sparse pseudo-gradients"
  "load|cargo bench -p iota-orchestrator --bench load|Orchestrator load: signed work polls per second (each in a session, and each with its own sr25519 signature) against an unsigned no-op, 1,000 miners in closed loops (throughput; latency there is miners / throughput; the cores each side kept busy in each window), then three rounds of each kind of signed poll offered half the no-op's rate (the median of every closed-loop no-op window so far, the last run just before the round) on a fixed schedule (latency from when each poll was due; each round also shows what it was offered as a share of the no-op windows just before and just after it, and what else the machine did meanwhile), the no-op at that pace for reference, and the CPU of the orchestrator's metagraph refresh at a new block"
  "load-paced|env IOTA_BENCH_POLL_INTERVAL_MS=1000 cargo bench -p iota-orchestrator --bench load|Orchestrator load, paced: 1,000 miners each polling once a second (latency)"
  "merging|cargo bench -p iota-orchestrator --bench merging|Merging at scale: how long the phase driver holds the exclusive phase lock (which work requests wait on) to start merging (freeze every partition's contributions, assign owners), for a reassignment round that gives every partition another owner, and to end an epoch with every partition still open, at 100, 1,000 and 4,000 partitions per stage"
  "uploads|cargo bench -p iota-orchestrator --bench uploads|Orchestrator memory under large uploads: the peak resident memory of the orchestrator's own process while 16 miners each upload a pseudo-gradient partition of 524 MB at once, through the orchestrator into a directory store, and presigned into an S3-compatible store (moto, started by this script) and then committed (goal: under 512 MB)"
  "clasp|cargo bench -p iota-validator --bench clasp|CLASP fit times"
  "replay|cargo bench -p iota-validator --bench replay_cost|Replay spot check cost against the miner's own compute"
  "power|cargo bench -p iota-validator --bench power|Check power at the defaults: CLASP detection and false-positive rates at 256 samples an epoch and pooled over the 10-epoch window, the replay draw's catch probability with 4 replays, and a caught cheater's payout against an honest miner's under the score decay"
  "chain|cargo bench -p iota-chain --bench chain|Chain client: metagraph sync next to the members read (uid, hotkey, permit) that a metagraph watcher makes at each block, building its storage keys (address checked per key or per entry), and set_weights round trip"
  "localnet|cargo bench -p iota-localnet --bench localnet|Localnet: start-up, transactions per second, storage iteration"
  "wan|scripts/bench-wan.sh|Training over shaped links: \`small\`, 3 stages x 2 miners, each \`iota miner\` in its own network namespace behind a veth pair shaped both ways by \`tc tbf\` (100 and 20 Mbit/s, bandwidth only) or unshaped, the link changed at each epoch boundary of one run (interleaved rounds); per epoch its wall time by phase, tokens/s, and per miner compute, hop I/O, all-reduce time and bytes; tokens/s of each link against the unshaped epochs (goal: at least 0.90 at 100 Mbit/s; needs root)"
  "wan-sparse|scripts/bench-wan.sh sparse|The same over 100 Mbit/s links with sparse pseudo-gradients (\`--pseudo-gradients top-128/4096 --merged-top 512 --outer-lr 1\`, outer momentum 0): tokens/s against the same run unshaped (needs root)"
)

# Comparisons made by hand (two commits side by side), each a section of its own.
HAND_MEASURED=(orchestrator/benches/restructure-before-after.md model/benches/cuda-attention-h200.md)

out="${BENCH_OUT:-BENCHMARKS.md}"
wanted=" $* "

cleanup=()
on_exit() { for c in "${cleanup[@]}"; do eval "$c" || true; done; }
trap on_exit EXIT
if [ -z "${DATABASE_URL:-}" ]; then
    eval "$(scripts/pg.sh start)"
    cleanup+=("scripts/pg.sh stop '$IOTA_PG_DIR'")
fi
export DATABASE_URL
# The uploads benchmark also measures an S3-compatible store.
if [ -z "${IOTA_TEST_S3_ENDPOINT:-}" ] && { [ -z "${*:-}" ] || [[ "$wanted" == *" uploads "* ]]; }; then
    eval "$(scripts/s3.sh start)"
    cleanup+=("scripts/s3.sh stop '$IOTA_S3_DIR'")
fi

sections=target/bench
mkdir -p "$sections"
# Every section starts as the file has it, so that a section not run now keeps what was
# written into the file by hand since it was measured (a leftover copy here would undo that).
if [ -f "$out" ]; then
    awk -v dir="$sections" '
        /^```/ { fenced = !fenced }
        /^## / && !fenced { file = dir "/" $2 ".md"; printf "" > file }
        file != "" { print >> file }
    ' "$out"
fi
commit="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+uncommitted')"
failed=0
for entry in "${BENCHES[@]}"; do
    IFS='|' read -r name cmd what <<<"$entry"
    if [ -n "${*:-}" ] && [[ "$wanted" != *" $name "* ]]; then
        continue
    fi
    if [ "$name" = cpu-vs-torch ] && ! "${TORCH_PYTHON:-python3}" -c "import torch" 2>/dev/null; then
        echo "== $name: no PyTorch for ${TORCH_PYTHON:-python3} (set TORCH_PYTHON), skipped" >&2
        continue
    fi
    if [[ "$name" == wan* ]] && [ "$(id -u)" -ne 0 ]; then
        echo "== $name: needs root (network namespaces, veth pairs, tc), skipped" >&2
        continue
    fi
    if [[ "$cmd" == scripts/* ]]; then
        if [ ! -x "${cmd%% *}" ]; then
            echo "== $name: no ${cmd%% *}, skipped" >&2
            continue
        fi
    else
        bench="${cmd##* }"
        crate_dir="$(echo "$cmd" | sed -E 's/.*-p iota-([a-z]+).*/\1/')"
        if [ ! -f "$crate_dir/benches/$bench.rs" ]; then
            echo "== $name: no $crate_dir/benches/$bench.rs, skipped" >&2
            continue
        fi
    fi
    echo "== $name: $cmd" >&2
    log="$(mktemp)"
    load="$(cut -d' ' -f1-3 /proc/loadavg)"
    started=$(date +%s)
    status=ok
    if ! $cmd >"$log" 2>"$log.err"; then
        status="FAILED (exit code $?; last lines of its error output below)"
        failed=1
        tail -n 20 "$log.err" >>"$log"
    fi
    took=$(( $(date +%s) - started ))
    {
        echo "## $name"
        echo
        echo "$what. \`$cmd\` at \`$commit\`, $(date -u +'%Y-%m-%d %H:%M UTC'), $took s including the build; load average before: $load. Status: $status."
        echo
        echo '```text'
        cat "$log"
        echo '```'
        echo
    } >"$sections/$name.md"
    rm -f "$log" "$log.err"
done

{
    echo "# Benchmarks"
    echo
    echo "Written by \`scripts/bench.sh\`; each section names the commit and time it was measured at."
    echo
    echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) logical cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) memory, $(uname -sr), $(rustc --version)."
    echo "Benchmarks run one after another; ratios are taken within one benchmark (both sides in the same run)."
    echo "Figures from a shared or loaded machine move; compare ratios, not absolute rates, across machines."
    echo "Measured by hand on another machine, not by this script: the load benchmark on 16 cores, in \`orchestrator/benches/load-16-cores.md\`."
    echo "Measured by hand (each names its machine) and copied in last: ${HAND_MEASURED[*]}."
    echo
    for entry in "${BENCHES[@]}"; do
        name="${entry%%|*}"
        if [ -f "$sections/$name.md" ]; then cat "$sections/$name.md"; fi
    done
    for hand in "${HAND_MEASURED[@]}"; do
        cat "$hand"
        echo
    done
} >"$out"
echo "wrote $out" >&2
exit "$failed"
