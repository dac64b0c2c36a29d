#!/bin/bash
# Start vLLM-CPU (PEERS.md settings), wait until ready, print the start-up time.
cd /work/peers
start=$(date +%s.%N)
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_USE_AOT_COMPILE=0 \
VLLM_HOST_IP=127.0.0.1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/work/peers/vllm/lib/libiomp5.so \
  /work/peers/vllm/bin/vllm serve /work/peers/smollm2-hf --host 127.0.0.1 --port 8092 --dtype bfloat16 \
  --served-model-name smollm2 --max-model-len 4096 > /tmp/b/vllm_serve.log 2>&1 &
echo $! > /tmp/b/vllm.pid
until curl -sf http://127.0.0.1:8092/health > /dev/null; do
  sleep 1
  kill -0 $(cat /tmp/b/vllm.pid) 2>/dev/null || { echo "vllm died"; tail -20 /tmp/b/vllm_serve.log; exit 1; }
done
end=$(date +%s.%N)
echo "vLLM ready after $(echo "$end - $start" | bc) s"
