#!/bin/bash
# One `llmserve serve --block-size N` per argument, in order, each swept at rates 4, inf, inf on
# mixed-100: the rate-inf runs start from a KV pool that rate 4 has used (its free blocks scattered).
# Usage: docs/scripts/ab_block_size_serve.sh 16 32 16 32   (session 21; logs in /tmp/b/bs_*.log)
cd "$(git rev-parse --show-toplevel)"
mkdir -p /tmp/b
B=.venv/bin/llmserve
for size in "$@"; do
  $B serve --port 8000 --block-size "$size" > /tmp/b/bs_serve_$size.log 2>&1 &
  SP=$!
  until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 0.2; done
  sleep 2
  $B bench serve --url http://127.0.0.1:8000 --workload bench_results/mixed-100.jsonl --sweep 4,inf,inf \
    --output /tmp/b/bs_$size.json > /tmp/b/bs_bench_$size.log 2>&1
  echo "block size $size, total tok/s at rates 4, inf, inf: $(grep 'total tok/s' /tmp/b/bs_bench_$size.log | awk '{print $(NF-2)}' | tr '\n' ' ')"
  kill $SP; wait $SP 2>/dev/null
done
