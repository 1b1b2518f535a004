#include "blu/core/host_reads.h"

#include <atomic>

namespace blu {

namespace {
std::atomic<uint64_t> g_host_reads{0};
}  // namespace

uint64_t host_reads() { return g_host_reads.load(std::memory_order_relaxed); }
void count_host_read() { g_host_reads.fetch_add(1, std::memory_order_relaxed); }

}  // namespace blu
