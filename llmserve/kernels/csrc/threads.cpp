// Sets the CPUs each OpenMP thread of this process may run on (worker/cpu_binding.py says why). Linux
// only: elsewhere it sets nothing and says so.
#include <omp.h>
#ifdef __linux__
#include <sched.h>
#endif

#include "kernels.h"

ThreadShare& thread_share() {
  static thread_local ThreadShare share;
  return share;
}

bool set_omp_thread_cpus(const std::vector<std::vector<int64_t>>& cpus_per_thread) {
#ifndef __linux__
  return false;
#else
  const int num_threads = static_cast<int>(cpus_per_thread.size());
  if (num_threads == 0) {
    return false;
  }
  // One region as wide as the pool: thread t (0 is the calling thread) sets its own CPUs. Later
  // regions of this width (every torch and oneDNN op) run on the same pooled threads.
  std::vector<int> failed(num_threads, 1);  // stays 1 for a thread the runtime did not start
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t cpu : cpus_per_thread[thread]) {
      CPU_SET(static_cast<int>(cpu), &set);
    }
    failed[thread] = sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  for (int thread_failed : failed) {
    if (thread_failed) {
      return false;
    }
  }
  return true;
#endif
}
