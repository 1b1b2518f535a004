// backend/cuda/graph_memset: a recorded CUDA graph's small memset nodes, made kernel nodes.
// cuBLASLt puts a 4-byte memset before some of its Hopper kernels (the nvjet "tst" family): 50 a
// step in llama-250m's compiled step, 99 in GPT-2 124M's. In a replayed graph the GPU idles 3-6 µs
// around each such memset node, and ~1 µs around a kernel node: as kernel nodes they take the
// steps' gaps from 0.88-0.90 ms to 0.61 (Llama) and from 1.12-1.23 to 0.85 (GPT-2) on an H200
// (performance.md, "Memset nodes made kernels").
// Depends on the CUDA runtime. Keep: the rewritten graph writes the same bytes in the same order of
// dependencies; memsets over kSmallMemsetBytes, and any node with an edge that is not a plain
// dependency, are left as they are.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace blu::cuda {

inline constexpr size_t kSmallMemsetBytes = 64 << 10;

// Replaces each memset node of `graph` that writes at most kSmallMemsetBytes by a one-block kernel
// node with the same dependencies and dependents; returns how many it replaced. BLU_CUDA_CHECK on a
// graph call that fails.
int lower_small_memsets(cudaGraph_t graph);

// The nodes of `graph` of one type, in cudaGraphGetNodes' order.
std::vector<cudaGraphNode_t> graph_nodes(cudaGraph_t graph, cudaGraphNodeType type);

}  // namespace blu::cuda
