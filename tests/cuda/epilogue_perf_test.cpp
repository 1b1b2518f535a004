// The compiler's GEMM epilogues (compiler/epilogue.h) on a decoder written without hand fusion
// (tests/common/plain_decoder.h) at GPT-2 124M's width: B=16, T=1024, C=768, 4 layers of
// `x + linear(relu(linear(x, w1) + b1), w2, b2)`, then of `x + linear(gelu_tanh(linear(x, w1, b1)),
// w2, b2)`, a head of 8192 classes, bf16 weights, SGD. The same step eager, compiled without the
// pass, and compiled with it: ms per step (CUDA events over 10 steps after 3) and the caching
// allocator's peak. Not a pass/fail timing: it prints, and asserts only that the compiled step
// folds 2 ops per layer.
// Run on the GPU machine: ./build-cuda/tests/test_cuda --gtest_filter='EpiloguePerf.*'
#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/compiler/compile.h"
#include "blu/memory/allocator.h"
#include "common/plain_decoder.h"
#include "cuda/cuda_test_util.h"

namespace blu::test {
namespace {

struct Timing {
  double ms = 0;
  double peak_mib = 0;
  int epilogues = 0;
};

Timing time_plain(int mode, bool gelu) {  // mode 0 eager, 1 compiled without epilogues, 2 with
  cuda::Stream stream;
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &ws});
  PlainDecoder m(5, kGPU, PlainDecoderSize{.B = 16, .T = 1024, .C = 768, .V = 8192, .layers = 4, .gelu = gelu},
                 DType::bf16);
  Tensor idx = empty({m.n.B, m.n.T}, DType::i32, kGPU), tg = empty({m.n.B, m.n.T}, DType::i32, kGPU);
  {
    NoGradGuard ng;
    copy_(idx, to_device(m.batch(0).first, kGPU));
    copy_(tg, to_device(m.batch(0).second, kGPU));
  }
  std::ostringstream log;
  compiler::CompileOptions o;
  o.log_stream = &log;
  o.epilogues = mode == 2;
  compiler::CompiledStep cs(o);
  Tensor loss;
  auto one = [&] {
    if (mode == 0)
      loss = m.step(idx, tg, 1e-3);
    else
      cs.run({idx, tg}, [&] { loss = m.step(idx, tg, 1e-3); });
  };
  const int warmup = 3, iters = 10;
  for (int i = 0; i < warmup; ++i) one();
  BLU_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  Allocator& alloc = allocator_for(kGPU);
  alloc.reset_peak();
  cuda::Event start(true), stop(true);
  start.record(stream.get());
  for (int i = 0; i < iters; ++i) one();
  stop.record(stream.get());
  stop.synchronize();
  Timing t;
  t.ms = double(stop.elapsed_ms(start)) / iters;
  t.peak_mib = double(alloc.stats().peak_bytes) / (1 << 20);
  if (mode > 0 && !cs.variants().empty()) t.epilogues = cs.variants()[0]->epilogues;
  return t;
}

TEST(EpiloguePerf, PlainDecoderBf16) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const char* names[] = {"eager", "compiled, no epilogues", "compiled, GEMM epilogues"};
  for (bool gelu : {false, true}) {
    Timing t[3];
    for (int round = 0; round < 2; ++round)
      for (int mode = 0; mode < 3; ++mode) {
        t[mode] = time_plain(mode, gelu);
        std::printf("plain decoder bf16 B16 T1024 C768 L4 %s: %-26s %.3f ms/step, peak %.0f MiB, %d epilogues\n",
                    gelu ? "gelu" : "relu", names[mode], t[mode].ms, t[mode].peak_mib, t[mode].epilogues);
      }
    EXPECT_EQ(t[2].epilogues, 8);  // two a layer: bias and residual, or GELU and residual
    EXPECT_EQ(t[1].epilogues, 0);
  }
}

}  // namespace
}  // namespace blu::test
