// What the AMX tile kernels (amx_linear.cpp: bf16, gguf_tiles.cpp: int8) share: the tile state Linux
// hands a process on request, and the layout of a tile configuration (palette 1).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace crane_mp {

// Asked for once per process (arch_prctl ARCH_REQ_XCOMP_PERM for the 8 KB XTILEDATA state); false in
// builds without AMX or where the kernel refuses.
inline bool tile_state_granted() {
#if defined(__AMX_TILE__)
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// The 64 bytes ldtilecfg reads: tile t is rows[t] rows of colsb[t] bytes.
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

#if defined(__AMX_TILE__)
// ldtilecfg through our own asm, whose operand tells the compiler the 64 bytes are read: with GCC 12's
// _tile_loadconfig the stores that fill a local configuration were dropped as dead once the function
// was no longer inlined, and ldtilecfg faulted on the bytes left unset.
inline void load_tile_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }
#endif

}  // namespace crane_mp
