// Every entry of the op table (tests/ops/opinfo_*.cpp) on CUDA against the CPU reference, on
// the same fresh random inputs: forward output and every input gradient, in f32 and f64, with
// the samples' layouts (non-contiguous inputs stay non-contiguous on the GPU).
#include <gtest/gtest.h>

#include <algorithm>

#include "blu/backend/cuda/runtime.h"
#include "common/opinfo.h"
#include "cuda/cuda_test_util.h"

namespace blu::test {
namespace {

// The same values on the GPU, keeping the kind of layout the sample had.
Tensor like_on_gpu(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor g = to_device(contiguous(t), kGPU);
  return t.is_contiguous() ? g : noncontig(g);
}

void run_table(DType dtype, double tol_scale) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  int compared = 0;
  for (const OpInfo& op : opinfo_registry()) {
    Generator gen(4242);
    for (Sample& s : op.samples(dtype, gen)) {
      SCOPED_TRACE(op.name + " / " + s.desc + " / " + std::string(dtype_name(dtype)));
      std::vector<Tensor> cpu = s.inputs, gpu;
      for (const Tensor& t : cpu) gpu.push_back(like_on_gpu(t));
      std::vector<int> grads;
      for (size_t i = 0; i < cpu.size(); ++i) {
        if (op.differentiable && cpu[i].defined() && cpu[i].dtype() == dtype &&
            std::find(op.no_grad_inputs.begin(), op.no_grad_inputs.end(), int(i)) == op.no_grad_inputs.end()) {
          cpu[i].set_requires_grad(true);
          gpu[i].set_requires_grad(true);
          grads.push_back(int(i));
        }
      }
      Tensor out_c, out_g;
      try {
        out_c = op.fn(cpu);
        out_g = op.fn(gpu);
      } catch (const Error& e) {
        ADD_FAILURE() << "threw: " << e.what();
        continue;
      }
      ASSERT_TRUE(out_g.device().is_cuda()) << "output not on the GPU";
      const double atol = op.oracle_atol * tol_scale, rtol = op.oracle_rtol * tol_scale;
      EXPECT_EQ(compare(out_g.detach(), out_c.detach(), atol, rtol), "") << "forward";
      if (!grads.empty()) {
        Tensor r = rnd(gen, out_c.shape(), dtype);
        out_c.backward(r);
        out_g.backward(to_device(r, kGPU));
        for (int i : grads) {
          ASSERT_TRUE(gpu[i].grad().defined()) << "no GPU gradient for input " << i;
          EXPECT_TRUE(gpu[i].grad().device().is_cuda());
          EXPECT_EQ(compare(gpu[i].grad(), cpu[i].grad(), atol, rtol), "") << "gradient of input " << i;
        }
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 100);
  std::printf("compared %d samples on CUDA vs CPU in %s\n", compared, std::string(dtype_name(dtype)).c_str());
}

TEST(CudaVsCpu, EveryOpF32) { run_table(DType::f32, 10.0); }
TEST(CudaVsCpu, EveryOpF64) { run_table(DType::f64, 1.0); }

}  // namespace
}  // namespace blu::test
