// A recorded graph's small memset nodes made kernel nodes (backend/cuda/graph_memset.h): a graph of
// memsets of 4-, 2- and 1-byte elements, one of them 2-D with a pitch, a copy that reads what one of
// them wrote and a memset after that copy, and one memset over the size limit. After the rewrite
// the small ones are kernel nodes, the large one is still a memset node, the graph has as many
// edges as before, and its replay leaves the bytes a host model of the same operations, in the same
// order, gives.
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='GraphMemsetCuda*'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "blu/backend/cuda/graph_memset.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

size_t count_nodes(cudaGraph_t g, cudaGraphNodeType type) { return cuda::graph_nodes(g, type).size(); }

size_t count_edges(cudaGraph_t g) {
  size_t n = 0;
  BLU_CUDA_CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
  return n;
}

// Host model of a memset node.
void model_memset(std::vector<uint8_t>& mem, size_t at, const cudaMemsetParams& m) {
  for (size_t r = 0; r < m.height; ++r)
    for (size_t j = 0; j < m.width; ++j)
      std::memcpy(&mem[at + r * m.pitch + j * m.elementSize], &m.value, m.elementSize);
}

TEST(GraphMemsetCuda, SmallMemsetsBecomeKernelsThatWriteTheSameBytes) {
  SKIP_WITHOUT_CUDA();
  constexpr size_t kBytes = 256 << 10;
  uint8_t* base = nullptr;
  BLU_CUDA_CHECK(cudaMalloc(&base, kBytes));
  BLU_CUDA_CHECK(cudaMemset(base, 0xAB, kBytes));
  std::vector<uint8_t> want(kBytes, 0xAB);

  auto params = [&](size_t at, uint32_t value, uint32_t elem, size_t width, size_t height, size_t pitch) {
    cudaMemsetParams m{};
    m.dst = base + at;
    m.value = value;
    m.elementSize = elem;
    m.width = width;
    m.height = height;
    m.pitch = pitch;
    return m;
  };
  const cudaMemsetParams a = params(0, 0xDEADBEEF, 4, 8, 3, 64);  // 2-D: rows at 0, 64, 128
  const cudaMemsetParams b = params(512, 0x1234, 2, 5, 1, 0);
  const cudaMemsetParams c = params(1024, 0x7F, 1, 300, 1, 0);
  const cudaMemsetParams e = params(64 << 10, 0x33, 1, 128 << 10, 1, 0);  // over kSmallMemsetBytes
  const cudaMemsetParams f = params(2048 + 8, 0x01010101, 4, 2, 1, 0);

  cudaGraph_t graph = nullptr;
  BLU_CUDA_CHECK(cudaGraphCreate(&graph, 0));
  cudaGraphNode_t na, nb, nc, nd, ne, nf;
  BLU_CUDA_CHECK(cudaGraphAddMemsetNode(&na, graph, nullptr, 0, &a));
  BLU_CUDA_CHECK(cudaGraphAddMemsetNode(&nb, graph, nullptr, 0, &b));
  BLU_CUDA_CHECK(cudaGraphAddMemsetNode(&nc, graph, &na, 1, &c));
  const cudaGraphNode_t d_deps[] = {na, nc};
  // Reads the first row that a wrote: the copy sees it only if a still runs before it.
  BLU_CUDA_CHECK(cudaGraphAddMemcpyNode1D(&nd, graph, d_deps, 2, base + 2048, base, 32, cudaMemcpyDeviceToDevice));
  BLU_CUDA_CHECK(cudaGraphAddMemsetNode(&ne, graph, nullptr, 0, &e));
  // Overwrites part of what the copy wrote: the bytes are f's only if it still runs after the copy.
  BLU_CUDA_CHECK(cudaGraphAddMemsetNode(&nf, graph, &nd, 1, &f));
  model_memset(want, 0, a);
  model_memset(want, 512, b);
  model_memset(want, 1024, c);
  std::memcpy(&want[2048], &want[0], 32);
  model_memset(want, 64 << 10, e);
  model_memset(want, 2048 + 8, f);

  const size_t edges = count_edges(graph);
  ASSERT_EQ(edges, 4u);
  EXPECT_EQ(cuda::lower_small_memsets(graph), 4);
  EXPECT_EQ(count_nodes(graph, cudaGraphNodeTypeMemset), 1u) << "the large memset stays a memset node";
  EXPECT_EQ(count_nodes(graph, cudaGraphNodeTypeKernel), 4u);
  EXPECT_EQ(count_edges(graph), edges);
  EXPECT_EQ(cuda::lower_small_memsets(graph), 0) << "a second pass finds nothing to lower";

  cudaGraphExec_t exec = nullptr;
  BLU_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  BLU_CUDA_CHECK(cudaGraphLaunch(exec, nullptr));
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(kBytes);
  BLU_CUDA_CHECK(cudaMemcpy(got.data(), base, kBytes, cudaMemcpyDeviceToHost));
  size_t first_bad = kBytes;
  for (size_t i = 0; i < kBytes && first_bad == kBytes; ++i)
    if (got[i] != want[i]) first_bad = i;
  EXPECT_EQ(first_bad, kBytes) << "byte " << first_bad << ": got " << int(got[first_bad % kBytes]) << ", want "
                               << int(want[first_bad % kBytes]);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(base);
}

}  // namespace
}  // namespace blu
