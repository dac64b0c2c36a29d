// The tensor-parallel collectives of ranks on one host, through a shared-memory segment (shm_collectives.cpp).
#pragma once

#include "aten.h"

#include <cstdint>
#include <string>

class ShmCollectives {
 public:
  // Maps the segment at `path` (rank 0 creates it, `create`; the others open it once it exists). Each
  // rank has two slots of `slot_bytes`, used by alternate calls; a call waits at most `timeout_seconds`
  // for the other ranks, then throws naming the rank that did not arrive.
  ShmCollectives(const std::string& path, int64_t rank, int64_t world_size, int64_t slot_bytes,
                 double timeout_seconds, bool create);
  ~ShmCollectives();
  ShmCollectives(const ShmCollectives&) = delete;
  ShmCollectives& operator=(const ShmCollectives&) = delete;

  // The sum over the ranks of a contiguous float32 or bf16 tensor, in place; accumulated in float32 in
  // rank order, so every rank holds the same bits.
  void all_reduce(at::Tensor tensor);
  // Every rank's tensor (one shape and dtype on all) concatenated along the last dimension on rank 0;
  // an empty tensor on the others.
  at::Tensor gather_to_first(at::Tensor tensor);
  int64_t slot_bytes() const { return slot_bytes_; }

 private:
  char* slot(int64_t call, int64_t rank) const;
  void wait_all(uint64_t target, bool done_counters) const;

  int64_t rank_, world_size_, slot_bytes_;
  double timeout_seconds_;
  size_t mapped_bytes_ = 0;
  char* base_ = nullptr;
  uint64_t calls_ = 0;  // collectives this rank has run: the same sequence on every rank
};
