#!/bin/bash
# Fresh server per run, rate inf on mixed-100, alternating tcmalloc on/off.
cd "$(git rev-parse --show-toplevel)"
B=.venv/bin/llmserve
for i in 1 2; do
  for tc in 1 0; do
    LLMSERVE_TCMALLOC=$tc $B serve --port 8000 > /tmp/b/s4_tc_serve_${tc}_${i}.log 2>&1 &
    SP=$!
    until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 0.2; done
    P=$(pgrep -f "serve --port 8000" | tail -1)
    pre=$(tr '\0' '\n' < /proc/$P/environ | grep -c tcmalloc)
    $B bench serve --url http://127.0.0.1:8000 --workload bench_results/mixed-100.jsonl --request-rate inf --output bench_results/serve-tc$tc-$i.json > /tmp/b/s4_tc_${tc}_${i}.log 2>&1
    echo "run $i tcmalloc=$tc (preloaded: $pre): $(grep 'total tok/s' /tmp/b/s4_tc_${tc}_${i}.log)"
    kill $SP; wait $SP 2>/dev/null
  done
done
