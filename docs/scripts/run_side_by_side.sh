#!/bin/bash
# Side by side through HTTP on mixed-100: ours (fresh server per line), vLLM-CPU, ours again, one at a time,
# with the offline engine on the same file first and last (HTTP vs offline).
# Usage: docs/scripts/run_side_by_side.sh TAG   (session 5 ran it as s5, session 6 as s6, session 7 as s7)
# Logs in /tmp/b/TAG_*.log, JSON in bench_results/serve-TAG-*.json. Run with nothing else on the machine.
T=${1:?usage: run_side_by_side.sh TAG}
cd "$(git rev-parse --show-toplevel)"
mkdir -p /tmp/b
B=.venv/bin/llmserve
R=bench_results
step() { echo "=== $1 $(date +%T)"; }
ours() {  # $1: tag, $2: rates
  $B serve --port 8000 > /tmp/b/${T}_serve_$1.log 2>&1 &
  SP=$!
  until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 0.2; done
  $B bench serve --url http://127.0.0.1:8000 --workload $R/mixed-100.jsonl --sweep $2 --output $R/serve-${T}-$1.json > /tmp/b/${T}_bench_$1.log 2>&1
  grep -E "rate|total tok/s|ttft|tpot" /tmp/b/${T}_bench_$1.log
  kill $SP; wait $SP 2>/dev/null
}
offline() {  # $1: tag
  $B bench throughput --workload $R/mixed-100.jsonl --naive-batch-sizes none --output $R/offline-${T}-$1.json \
    > /tmp/b/${T}_offline_$1.log 2>&1
  grep -E "continuous|tok/s" /tmp/b/${T}_offline_$1.log | tail -3
}
step offline-1; offline 1
step ours-sweep; ours sweep 2,4,inf
step ours-inf-1; ours inf1 inf
step vllm
docs/scripts/vllm_serve.sh > /tmp/b/${T}_vllm_start.log 2>&1 && cat /tmp/b/${T}_vllm_start.log && \
  $B bench serve --url http://127.0.0.1:8092 --model smollm2 --workload $R/mixed-100.jsonl --sweep 2,4,inf --output $R/serve-${T}-vllm.json > /tmp/b/${T}_bench_vllm.log 2>&1
grep -E "rate|total tok/s|ttft|tpot" /tmp/b/${T}_bench_vllm.log
kill $(cat /tmp/b/vllm.pid) 2>/dev/null; sleep 3; pkill -f "vllm serve"; sleep 2
step ours-inf-2; ours inf2 inf
step offline-2; offline 2
step done
