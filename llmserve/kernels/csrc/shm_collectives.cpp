// All-reduce and gather between tensor-parallel ranks on one host, through shared memory.
//
// A decode step all-reduces two small tensors per layer (a few KiB each). Through gloo each costs
// tens of microseconds of socket round trips; here it is a copy into this rank's slot, a flag, a spin
// until every rank's flag is up, and a sum read from the slots: a few microseconds, and callable from
// inside the fused decode stack (decode_stack.cpp) without going back to Python.
//
// Per rank the segment holds two counters on their own cache lines, `arrived` (the calls whose data is
// in its slot) and `done` (the calls it has finished reading), its pid, then two slots, one for even
// and one for odd calls. A rank that waits long looks up the pid it waits on: a rank that died ends
// the wait at once (gloo would see its socket close; shared memory says nothing). Before writing into its slot for call c a rank waits until every rank is done with
// call c - 2, whose data that slot still holds.
#include "shm_collectives.h"

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

namespace {

constexpr size_t kCounterStride = 128;  // arrived at +0, done at +64 (each on its own cache line), pid at +96
constexpr int64_t kSpinsBeforeYield = 4096;  // then yield the core: more ranks than cores must still progress

size_t header_bytes(int64_t world_size) { return ((world_size * kCounterStride + 4095) / 4096) * 4096; }

std::atomic<uint64_t>* counter(char* base, int64_t rank, bool done) {
  return reinterpret_cast<std::atomic<uint64_t>*>(base + rank * kCounterStride + (done ? 64 : 0));
}

std::atomic<int64_t>* pid_of(char* base, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + rank * kCounterStride + 96);
}

// Whether process `pid` still runs: not gone, and not a zombie waiting to be reaped.
bool process_runs(int64_t pid) {
  if (pid <= 0) return true;  // not yet known
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* file = fopen(path.c_str(), "r");
  if (file == nullptr) return false;
  char buffer[512];
  const size_t length = fread(buffer, 1, sizeof(buffer) - 1, file);
  fclose(file);
  buffer[length] = '\0';
  const char* name_end = strrchr(buffer, ')');  // the state follows the command name, which may hold spaces
  return name_end == nullptr || (name_end[1] == ' ' && name_end[2] != 'Z' && name_end[2] != 'X');
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch rounds (no NaN inputs here)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// out[i] = sum over ranks of slots[r][i], float32 accumulation in rank order
template <typename T>
void sum_slots(const std::vector<const T*>& slots, T* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float sum = 0.0f;
    for (const T* slot : slots) {
      if constexpr (std::is_same_v<T, float>) {
        sum += slot[i];
      } else {
        sum += bf16_to_float(slot[i]);
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      out[i] = sum;
    } else {
      out[i] = float_to_bf16(sum);
    }
  }
}

}  // namespace

ShmCollectives::ShmCollectives(const std::string& path, int64_t rank, int64_t world_size, int64_t slot_bytes,
                               double timeout_seconds, bool create)
    : rank_(rank), world_size_(world_size), slot_bytes_(slot_bytes), timeout_seconds_(timeout_seconds) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "ShmCollectives: bad rank ", rank, " of ", world_size);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "ShmCollectives: slot_bytes must be a positive multiple of 64");
  mapped_bytes_ = header_bytes(world_size) + 2 * world_size * static_cast<size_t>(slot_bytes);
  const int fd = create ? open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600) : open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "ShmCollectives: cannot open ", path, ": ", std::strerror(errno));
  if (create) {
    // reserve the pages now: on a full tmpfs a later first touch would be a SIGBUS, not an error
    const int error = posix_fallocate(fd, 0, static_cast<off_t>(mapped_bytes_));
    if (error != 0) {
      close(fd);
      unlink(path.c_str());
      TORCH_CHECK(false, "ShmCollectives: cannot reserve ", mapped_bytes_, " bytes at ", path, ": ", std::strerror(error));
    }
  } else {
    struct stat info {};
    const bool sized = fstat(fd, &info) == 0 && static_cast<size_t>(info.st_size) == mapped_bytes_;
    if (!sized) close(fd);
    TORCH_CHECK(sized, "ShmCollectives: ", path, " is not a segment of ", mapped_bytes_, " bytes");
  }
  void* mapped = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TORCH_CHECK(mapped != MAP_FAILED, "ShmCollectives: cannot map ", path, ": ", std::strerror(errno));
  base_ = static_cast<char*>(mapped);
  pid_of(base_, rank_)->store(getpid(), std::memory_order_release);
}

ShmCollectives::~ShmCollectives() {
  if (base_ != nullptr) munmap(base_, mapped_bytes_);
}

char* ShmCollectives::slot(int64_t call, int64_t rank) const {
  return base_ + header_bytes(world_size_) + ((call % 2) * world_size_ + rank) * static_cast<size_t>(slot_bytes_);
}

void ShmCollectives::wait_all(uint64_t target, bool done_counters) const {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < world_size_; ++r) {
    const std::atomic<uint64_t>* flag = counter(base_, r, done_counters);
    for (int64_t spins = 0; flag->load(std::memory_order_acquire) < target; ++spins) {
      if (spins < kSpinsBeforeYield) {
        _mm_pause();
        continue;
      }
      sched_yield();
      if (spins % 1024 == 0) {
        const int64_t pid = pid_of(base_, r)->load(std::memory_order_acquire);
        TORCH_CHECK(process_runs(pid), "tensor-parallel rank ", r, " (pid ", pid,
                    ") exited during a collective (shared-memory collectives)");
        const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
        TORCH_CHECK(waited.count() < timeout_seconds_, "tensor-parallel rank ", r, " did not reach collective ",
                    target, " within ", timeout_seconds_, " s (shared-memory collectives)");
      }
    }
  }
}

void ShmCollectives::all_reduce(at::Tensor tensor) {
  TORCH_CHECK(tensor.is_contiguous() && tensor.device().is_cpu(), "all_reduce: a contiguous CPU tensor");
  TORCH_CHECK(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kBFloat16,
              "all_reduce: float32 or bfloat16");
  const int64_t bytes = tensor.numel() * tensor.element_size();
  TORCH_CHECK(bytes <= slot_bytes_, "all_reduce: ", bytes, " bytes exceed the slot's ", slot_bytes_);
  const uint64_t call = calls_++;
  if (call >= 2) wait_all(call - 1, /*done_counters=*/true);  // nobody still reads this slot's call - 2
  std::memcpy(slot(call, rank_), tensor.data_ptr(), bytes);
  counter(base_, rank_, false)->store(call + 1, std::memory_order_release);
  wait_all(call + 1, /*done_counters=*/false);
  const int64_t numel = tensor.numel();
  const int64_t grain = numel >= (1 << 16) ? (1 << 14) : numel + 1;  // a decode step's tensors: one thread
  if (tensor.scalar_type() == at::kFloat) {
    std::vector<const float*> slots;
    for (int64_t r = 0; r < world_size_; ++r) slots.push_back(reinterpret_cast<const float*>(slot(call, r)));
    float* out = tensor.data_ptr<float>();
    at::parallel_for(0, numel, grain, [&](int64_t begin, int64_t end) { sum_slots(slots, out, begin, end); });
  } else {
    std::vector<const uint16_t*> slots;
    for (int64_t r = 0; r < world_size_; ++r) slots.push_back(reinterpret_cast<const uint16_t*>(slot(call, r)));
    auto* out = reinterpret_cast<uint16_t*>(tensor.data_ptr());
    at::parallel_for(0, numel, grain, [&](int64_t begin, int64_t end) { sum_slots(slots, out, begin, end); });
  }
  counter(base_, rank_, true)->store(call + 1, std::memory_order_release);
}

at::Tensor ShmCollectives::gather_to_first(at::Tensor tensor) {
  tensor = tensor.contiguous();
  TORCH_CHECK(tensor.device().is_cpu() && tensor.dim() >= 1, "gather_to_first: a CPU tensor");
  const int64_t bytes = tensor.numel() * tensor.element_size();
  TORCH_CHECK(bytes <= slot_bytes_, "gather_to_first: ", bytes, " bytes exceed the slot's ", slot_bytes_);
  const uint64_t call = calls_++;
  if (call >= 2) wait_all(call - 1, /*done_counters=*/true);
  std::memcpy(slot(call, rank_), tensor.data_ptr(), bytes);
  counter(base_, rank_, false)->store(call + 1, std::memory_order_release);
  at::Tensor gathered;
  if (rank_ == 0) {
    wait_all(call + 1, /*done_counters=*/false);
    const int64_t cols = tensor.size(-1), rows = tensor.numel() / std::max<int64_t>(cols, 1);
    auto sizes = tensor.sizes().vec();
    sizes.back() = cols * world_size_;
    gathered = at::empty(sizes, tensor.options());
    const int64_t row_bytes = cols * tensor.element_size();
    auto* out = static_cast<char*>(gathered.data_ptr());
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        for (int64_t r = 0; r < world_size_; ++r)
          std::memcpy(out + (row * world_size_ + r) * row_bytes, slot(call, r) + row * row_bytes, row_bytes);
    });
  } else {
    gathered = at::empty({0}, tensor.options());
  }
  counter(base_, rank_, true)->store(call + 1, std::memory_order_release);
  return gathered;
}
