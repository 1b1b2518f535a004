// Note [Host heap]
// A compiled step's host capture makes and frees ~56 small objects an op (the op's record, its
// values, autograd's nodes, shape vectors: ~17,000 for the tiny Llama's 303 ops), and the GPU
// waits at each step's start for the capture of its first segment and then whenever the capture
// falls behind the kernels (Note [Streamed replay], compiler/compile.h). glibc's malloc made a loop
// of such captures ~3x slower than mimalloc does (docs/performance.md, "The host heap"),
// so the blutrain executable is linked against mimalloc (Debian's libmimalloc-dev; CMake option
// BLU_MIMALLOC, on when the package is found and no sanitizer is built). Linked into the
// executable, its malloc and free precede glibc's in symbol lookup and serve every allocation of
// the process, the shared libraries' (CUDA's, NCCL's, the compiled CPU kernels') included. The
// library and the Python module do not link it: an interpreter that loads the module has its heap
// already, and two allocators must not free each other's blocks. Sanitizer builds keep their own
// (ASan and TSan replace malloc themselves).
#include "host_heap.h"

#include <cstdlib>
#include <string>

#ifdef BLU_HAVE_MIMALLOC
#include <mimalloc.h>
#endif

namespace blu::cli {

std::string host_heap() {
#ifdef BLU_HAVE_MIMALLOC
  const int v = mi_version();  // major·100 + minor·10 + patch (2.0.9: 209)
  const std::string name = "mimalloc " + std::to_string(v / 100) + "." + std::to_string(v / 10 % 10) + "." +
                           std::to_string(v % 10);
  void* p = std::malloc(64);
  asm volatile("" : : "r"(p) : "memory");  // a real call, not folded away
  const bool ours = mi_is_in_heap_region(p);
  std::free(p);
  if (!ours) return name + " linked, but malloc is another allocator's (one preloaded before it?)";
  return name + " (the process's malloc and free)";
#else
  return "the default malloc (this build does not link mimalloc)";
#endif
}

}  // namespace blu::cli
