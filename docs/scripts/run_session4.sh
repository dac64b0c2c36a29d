#!/bin/bash
# Logs go to /tmp/b (create it first); the vLLM peer as in shared/PEERS.md.
# Session 4 quiet benchmarks. Logs in /tmp/b/s4_*.log, JSON in bench_results/.
cd "$(git rev-parse --show-toplevel)"
B=.venv/bin/llmserve
R=bench_results
step() { echo "=== $1 $(date +%T)"; }
step ab-fused; for n in 1 64; do .venv/bin/python docs/scripts/ab_fused.py $n; done > /tmp/b/s4_ab_fused.log 2>&1
step latency;   $B bench latency --prompt-lengths 16,128,512,1024 --decode-tokens 64 --output $R/latency.json --plot $R/latency.png > /tmp/b/s4_latency.log 2>&1
step profile;   .venv/bin/python docs/scripts/decode_step_profile.py > /tmp/b/s4_profile.log 2>&1
step throughput; $B bench throughput --workload $R/mixed-100.jsonl --naive-batch-sizes 8 --output $R/throughput.json --plot $R/throughput.png > /tmp/b/s4_throughput.log 2>&1
step serve-ours
$B serve --port 8000 > /tmp/b/s4_serve_ours.log 2>&1 &
SP=$!
until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 0.2; done
$B bench serve --url http://127.0.0.1:8000 --workload $R/mixed-100.jsonl --sweep 2,4,inf --output $R/serve-ours.json --plot $R/serve-ours.png > /tmp/b/s4_serve_ours_bench.log 2>&1
kill $SP; wait $SP 2>/dev/null
step serve-ours-no-tcmalloc
LLMSERVE_TCMALLOC=0 $B serve --port 8000 > /tmp/b/s4_serve_ours_nt.log 2>&1 &
SP=$!
until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 0.2; done
$B bench serve --url http://127.0.0.1:8000 --workload $R/mixed-100.jsonl --request-rate inf --output $R/serve-ours-no-tcmalloc.json > /tmp/b/s4_serve_ours_nt_bench.log 2>&1
kill $SP; wait $SP 2>/dev/null
step vllm
docs/scripts/vllm_serve.sh > /tmp/b/s4_vllm_start.log 2>&1 && \
  $B bench serve --url http://127.0.0.1:8092 --model smollm2 --workload $R/mixed-100.jsonl --sweep 2,4,inf --output $R/serve-vllm.json --plot $R/serve-vllm.png > /tmp/b/s4_serve_vllm_bench.log 2>&1
kill $(cat /tmp/b/vllm.pid) 2>/dev/null; sleep 3; pkill -f "vllm serve" ; sleep 2
step spec
$B bench spec-decode --methods ngram --num-prompts 5 --max-tokens 128 --batch-sizes 1,4,16,64 --throughput-method ngram --throughput-repeats 3 --output $R/spec-decode-s4.json > /tmp/b/s4_spec.log 2>&1
step ppl
for q in none int8 int4; do
  if [ $q = none ]; then F=""; else F="--quantization $q"; fi
  echo "--- $q"; $B eval ppl --max-tokens 2048 --context 512 --decode-tokens 64 --kv-cache-memory 256MiB $F 2>&1 | tail -6
done > /tmp/b/s4_ppl.log
step done
