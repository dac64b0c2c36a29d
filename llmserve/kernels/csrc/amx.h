// AMX's tile registers as the kernels use them: the process's permission and the one tile shape.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLMSERVE_AMX 1

// Linux hands out AMX's tile state only to a process that asks for it (oneDNN asks too; asking twice is fine).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// Palette 1, tiles 0-7 all 16 rows of 64 bytes (16 x 16 float32, or 16 x 32 bf16 as 16 pairs a row).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
#endif
