// A CUPTI injection library that writes every kernel, memcpy and memset a process runs on the GPU,
// with its start and end in ns, to a CSV — the timeline of a timed run (power cap, clocks and the
// gaps between kernels as they are), which ncu (every kernel alone) does not give and the GPU
// machine has no nsys for. The driver loads it through CUDA_INJECTION64_PATH; kernels inside CUDA
// graphs are recorded node by node. scripts/lab/timeline_steps.py reads the file.
//
//   g++ -O2 -shared -fPIC -std=c++17 -I/usr/local/cuda/include -o /tmp/libkernel_timeline.so \
//       scripts/lab/kernel_timeline.cpp -L/usr/local/cuda/lib -lcupti
//   CUDA_INJECTION64_PATH=/tmp/libkernel_timeline.so BLU_TIMELINE_FILE=/tmp/t.csv blutrain bench ...
//
// Rows: kind (K kernel, C memcpy, S memset), start, end, stream, name (kernels, demangled) or bytes.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace {

FILE* out = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(16) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        int status = 0;
        char* plain = k->name ? abi::__cxa_demangle(k->name, nullptr, nullptr, &status) : nullptr;
        std::fprintf(out, "K,%llu,%llu,%u,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                     k->streamId, plain ? plain : k->name ? k->name : "?");
        std::free(plain);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        std::fprintf(out, "C,%llu,%llu,%u,%llu\n", (unsigned long long)m->start, (unsigned long long)m->end,
                     m->streamId, (unsigned long long)m->bytes);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        std::fprintf(out, "S,%llu,%llu,%u,%llu\n", (unsigned long long)m->start, (unsigned long long)m->end,
                     m->streamId, (unsigned long long)m->bytes);
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void flush_at_exit() {
  cuptiActivityFlushAll(1);
  if (out) std::fclose(out);
  out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("BLU_TIMELINE_FILE");
  out = std::fopen(path && *path ? path : "timeline.csv", "w");
  if (!out) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
  for (CUpti_ActivityKind kind :
       {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET})
    if (cuptiActivityEnable(kind) != CUPTI_SUCCESS) return 0;
  std::atexit(flush_at_exit);
  return 1;
}
