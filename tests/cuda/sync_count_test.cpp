// Every synchronisation and synchronous copy the host makes during training, counted by
// intercepting the CUDA runtime: this binary defines the runtime functions that block the host
// (and the ones that synchronise implicitly: cudaMalloc, cudaFree, pinned allocation, cudaMemset,
// cudaMemcpy, and cudaMemcpyAsync to or from pageable host memory), counts each call while
// counting is on, and forwards it to the real one (dlsym RTLD_NEXT). Calls from inside this
// executable — all of BluTrain — go through these definitions. Ten steady-state training steps
// of a GPT-2 and of a Llama in bf16 may synchronise only where a logged step reads its loss and
// norm (Strategy::read: one copy to the host and the stream synchronisation that waits for it per
// logged step); anything more fails with the list of what was called. The CPU's counterpart is tests/train/host_reads_step_test.cpp.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/models/registry.h"
#include "blu/train/trainer.h"
#include "cuda/cuda_test_util.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace {

std::atomic<bool> g_counting{false};
std::mutex g_mu;
std::map<std::string, int>& calls() {
  static std::map<std::string, int> m;
  return m;
}
void count(const char* name) {
  if (!g_counting.load()) return;
  std::lock_guard lock(g_mu);
  ++calls()[name];
}

template <typename F>
F real(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (!p) std::abort();  // the runtime always has these
  return reinterpret_cast<F>(p);
}

bool pageable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered;
}

}  // namespace

extern "C" {

cudaError_t cudaDeviceSynchronize() {
  count("cudaDeviceSynchronize");
  static auto f = real<cudaError_t (*)()>("cudaDeviceSynchronize");
  return f();
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  count("cudaStreamSynchronize");
  static auto f = real<cudaError_t (*)(cudaStream_t)>("cudaStreamSynchronize");
  return f(s);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  count("cudaEventSynchronize");
  static auto f = real<cudaError_t (*)(cudaEvent_t)>("cudaEventSynchronize");
  return f(e);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  count("cudaMemcpy");
  static auto f = real<cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind)>("cudaMemcpy");
  return f(dst, src, n, k);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind k, cudaStream_t s) {
  if (k == cudaMemcpyDeviceToHost && pageable(dst)) count("cudaMemcpyAsync device to pageable host");
  if (k == cudaMemcpyHostToDevice && pageable(src)) count("cudaMemcpyAsync pageable host to device");
  static auto f = real<cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t)>("cudaMemcpyAsync");
  return f(dst, src, n, k, s);
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  count("cudaMemset");
  static auto f = real<cudaError_t (*)(void*, int, size_t)>("cudaMemset");
  return f(p, v, n);
}
cudaError_t cudaMalloc(void** p, size_t n) {
  count("cudaMalloc");
  static auto f = real<cudaError_t (*)(void**, size_t)>("cudaMalloc");
  return f(p, n);
}
cudaError_t cudaFree(void* p) {
  count("cudaFree");
  static auto f = real<cudaError_t (*)(void*)>("cudaFree");
  return f(p);
}
cudaError_t cudaMallocHost(void** p, size_t n) {
  count("cudaMallocHost");
  static auto f = real<cudaError_t (*)(void**, size_t)>("cudaMallocHost");
  return f(p, n);
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int flags) {
  count("cudaHostAlloc");
  static auto f = real<cudaError_t (*)(void**, size_t, unsigned int)>("cudaHostAlloc");
  return f(p, n, flags);
}
cudaError_t cudaFreeHost(void* p) {
  count("cudaFreeHost");
  static auto f = real<cudaError_t (*)(void*)>("cudaFreeHost");
  return f(p);
}

}  // extern "C"

namespace blu::train {
namespace {

using test::TempDir;

// Trains `model` for 15 steps, logging every 5th; counts over steps 6..15 (after warm-up: the
// caching allocator has its blocks, cuBLASLt its plans), which hold two logged steps.
void expect_syncs_only_on_logged_steps(const nlohmann::json& model, const std::string& precision) {
  TempDir data;
  test_util::write_toy_shards(data.path(), 512, 4096, 65536);
  TrainOptions o = test_util::toy_run(data.path(), "", 512, precision);
  o.model = model;
  o.val_pattern = "";
  o.device = "cuda";
  o.batch_size = 4;
  o.seq_len = 64;
  o.grad_accum = 2;
  o.steps = 15;
  o.log_every = 5;
  o.grad_clip = 0.5;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) {
    if (s.step == 5) {
      std::lock_guard lock(g_mu);
      calls().clear();
      g_counting = true;
    }
    if (s.step == 15) g_counting = false;
  };
  Trainer t(o, cb);
  t.run();
  g_counting = false;
  std::string got;
  int total = 0;
  for (const auto& [name, n] : calls()) {
    got += name + " x" + std::to_string(n) + "; ";
    total += n;
  }
  // Steps 10 and 15 read their values: a copy to the host and the stream synchronisation that waits
  // for it, nothing else.
  EXPECT_EQ(calls()["cudaStreamSynchronize"], 2) << got;
  EXPECT_EQ(calls()["cudaMemcpyAsync device to pageable host"], 2) << got;
  EXPECT_EQ(total, 4) << "host synchronisations over 10 steps (2 logged): " << got;
}

TEST(SyncCount, Gpt2Bf16OnlyLoggedStepsSynchronise) {
  SKIP_WITHOUT_CUDA();
  nlohmann::json m = models::resolve_model_config("gpt2:tiny");
  m["vocab_size"] = 512, m["padded_vocab_size"] = 512, m["n_embd"] = 128, m["block_size"] = 64;
  expect_syncs_only_on_logged_steps(m, "bf16");
}

// fp16: the loss scale, its unscaling and its overflow decision stay on the device as well.
TEST(SyncCount, Gpt2Fp16OnlyLoggedStepsSynchronise) {
  SKIP_WITHOUT_CUDA();
  nlohmann::json m = models::resolve_model_config("gpt2:tiny");
  m["vocab_size"] = 512, m["padded_vocab_size"] = 512, m["n_embd"] = 128, m["block_size"] = 64;
  expect_syncs_only_on_logged_steps(m, "fp16");
}

TEST(SyncCount, LlamaBf16OnlyLoggedStepsSynchronise) {
  SKIP_WITHOUT_CUDA();
  nlohmann::json m = models::resolve_model_config("llama:tiny");  // widened to head dim 64: the flash kernels
  m["vocab_size"] = 512, m["hidden_size"] = 256, m["num_attention_heads"] = 4, m["num_key_value_heads"] = 2;
  m["intermediate_size"] = 512;
  expect_syncs_only_on_logged_steps(m, "bf16");
}

}  // namespace
}  // namespace blu::train
