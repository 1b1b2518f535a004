// backend/cuda/graph_memset: see graph_memset.h.
#include <cstdint>
#include <vector>

#include "blu/backend/cuda/graph_memset.h"
#include "blu/core/cuda/runtime.h"

namespace blu::cuda {

namespace {

// A memset node's bytes: `height` rows of `width` elements of `elem` bytes, `pitch` bytes apart.
__global__ void small_memset_kernel(char* dst, size_t pitch, uint32_t value, uint32_t elem, size_t width,
                                    size_t height) {
  const size_t n = width * height;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    char* row = dst + (i / width) * pitch;
    const size_t j = i % width;
    if (elem == 4)
      reinterpret_cast<uint32_t*>(row)[j] = value;
    else if (elem == 2)
      reinterpret_cast<uint16_t*>(row)[j] = uint16_t(value);
    else
      reinterpret_cast<uint8_t*>(row)[j] = uint8_t(value);
  }
}

bool plain_edges(const std::vector<cudaGraphEdgeData>& edges) {
  for (const cudaGraphEdgeData& e : edges)
    if (e.from_port != 0 || e.to_port != 0 || e.type != cudaGraphDependencyTypeDefault) return false;
  return true;
}

}  // namespace

std::vector<cudaGraphNode_t> graph_nodes(cudaGraph_t graph, cudaGraphNodeType type) {
  size_t count = 0;
  BLU_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  BLU_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  std::erase_if(nodes, [&](cudaGraphNode_t node) {
    cudaGraphNodeType t{};
    BLU_CUDA_CHECK(cudaGraphNodeGetType(node, &t));
    return t != type;
  });
  return nodes;
}

int lower_small_memsets(cudaGraph_t graph) {
  int lowered = 0;
  for (cudaGraphNode_t node : graph_nodes(graph, cudaGraphNodeTypeMemset)) {
    cudaMemsetParams m{};
    BLU_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
    if (m.width * m.height * m.elementSize > kSmallMemsetBytes) continue;
    size_t n_in = 0, n_out = 0;
    BLU_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n_in));
    BLU_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &n_out));
    std::vector<cudaGraphNode_t> in(n_in), out(n_out);
    std::vector<cudaGraphEdgeData> in_edges(n_in), out_edges(n_out);
    BLU_CUDA_CHECK(cudaGraphNodeGetDependencies(node, in.data(), in_edges.data(), &n_in));
    BLU_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, out.data(), out_edges.data(), &n_out));
    if (!plain_edges(in_edges) || !plain_edges(out_edges)) continue;
    char* dst = static_cast<char*>(m.dst);
    size_t pitch = m.pitch;
    uint32_t value = m.value, elem = m.elementSize;
    size_t width = m.width, height = m.height;
    void* args[] = {&dst, &pitch, &value, &elem, &width, &height};
    cudaKernelNodeParams k{};
    k.func = reinterpret_cast<void*>(&small_memset_kernel);
    k.gridDim = dim3(1);
    k.blockDim = dim3(256);
    k.kernelParams = args;
    cudaGraphNode_t kernel = nullptr;
    BLU_CUDA_CHECK(cudaGraphAddKernelNode(&kernel, graph, in.data(), n_in, &k));
    for (cudaGraphNode_t d : out) BLU_CUDA_CHECK(cudaGraphAddDependencies(graph, &kernel, &d, nullptr, 1));
    BLU_CUDA_CHECK(cudaGraphDestroyNode(node));
    ++lowered;
  }
  return lowered;
}

}  // namespace blu::cuda
