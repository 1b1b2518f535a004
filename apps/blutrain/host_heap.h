// apps/blutrain/host_heap: which allocator serves the process's malloc and free (Note [Host heap]).
#pragma once
#include <string>

namespace blu::cli {

// "mimalloc 2.0.9 (the process's malloc and free)", or the default malloc in a build without it
// (glibc's, or a sanitizer's); says so when the build links mimalloc but malloc is another's (an
// allocator in LD_PRELOAD).
std::string host_heap();

}  // namespace blu::cli
