#!/bin/bash
cd "$(git rev-parse --show-toplevel)"
B=.venv/bin/llmserve
for budget in 512 2048; do
  $B serve --port 8000 --max-num-batched-tokens $budget > /tmp/b/s4_budget_$budget.log 2>&1 &
  SP=$!
  until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 0.2; done
  $B bench serve --url http://127.0.0.1:8000 --workload bench_results/mixed-100.jsonl --sweep 2,inf --output bench_results/serve-budget-$budget.json > /tmp/b/s4_budget_bench_$budget.log 2>&1
  kill $SP; wait $SP 2>/dev/null
  echo "budget $budget"; grep -A8 "^\[rate" /tmp/b/s4_budget_bench_$budget.log | grep "rate\|throughput\|ttft\|tpot"
done
