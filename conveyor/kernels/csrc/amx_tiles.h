// What the AMX kernels share (linear_amx.cpp: bf16 tiles; linear_w8a8.cpp: int8 tiles): whether this CPU and
// Linux let this process use the tiles, and the one tile configuration both use (8 tiles of 16 rows x 64 bytes).
// Included only where the variant compiles AMX intrinsics (__AMX_TILE__, Linux).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace conveyor {
namespace CONVEYOR_VARIANT {
namespace amx {

// CPUID leaf 7, EDX: the AMX features a kernel needs besides the tiles themselves (bit 24).
constexpr unsigned kBf16 = 22, kInt8 = 25;

// Whether this CPU has AMX tiles with `feature` (kBf16 or kInt8) and Linux hands this process the tile state
// (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA): a variant built with AMX also runs on CPUs without it (an AMD
// Zen 4 or 5 has AVX-512 BF16 and VNNI), where these kernels stay out of the table.
inline bool ready(unsigned feature) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> feature) & 1u)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes, on the calling thread (each thread of a parallel region loads its own).
inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace amx
}  // namespace CONVEYOR_VARIANT
}  // namespace conveyor
