// compiler/codegen/kernel_cache: the persistent on-disk cache of compiled fused-region kernels.
// An entry is one file <dir>/<key>.<ext> (a shared object for the CPU, a cubin for CUDA, a fusion
// plan), <key>.sum holding its byte count and a 128-bit hash of its bytes, and <key>.txt holding
// the region text it was compiled from; the key is a 64-bit hash (hex) of the
// region's text (region.h) with the source the emitter generates for it, the target
// ("cpu-x86_64", "cuda-sm_90a") and the toolchain version (the C++ compiler's, or NVRTC's), so a
// change in any of them — an emitter's included — misses. The directory is
// $BLU_KERNEL_CACHE, else $XDG_CACHE_HOME/blutrain/kernels, else ~/.cache/blutrain/kernels.
// `blutrain compile` fills it where MLIR is installed; a build without MLIR only reads it.
// Depends on io/json_file (the atomic write) and nothing of the compiler but the region text.
// Keep: entries are written atomically (temporary file, fsync, rename), so a killed compile or a
// crashed machine never leaves a half-written kernel; a hit is checked against the stored region text (a hash collision is a
// miss, never a wrong kernel) and its artefact against its sum (bytes damaged on disk are a miss,
// logged, and the entry is made again; an entry with no sum file is taken unchecked, so caches
// filled by earlier versions still load).
#pragma once
#include <optional>
#include <string>

namespace blu::compiler {

std::string kernel_cache_dir();
std::string kernel_cache_key(const std::string& region_text, const std::string& target, const std::string& toolchain);

// A cache hit: the artefact's path and the bytes that were checked against its sum. A caller
// that can take bytes (a cubin, a plan) uses these, so what it loads is what was checked.
struct CacheEntry {
  std::string path, bytes;
};
// The entry for `key` when it exists and its stored text equals `region_text`.
std::optional<CacheEntry> kernel_cache_find(const std::string& key, const std::string& ext,
                                            const std::string& region_text);
// Stores `bytes` as the entry for `key` (atomically) and returns its path.
std::string kernel_cache_store(const std::string& key, const std::string& ext, const std::string& bytes,
                               const std::string& region_text);

}  // namespace blu::compiler
