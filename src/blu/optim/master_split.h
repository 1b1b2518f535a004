// optim/master_split: fp32 master weights held as their bf16 compute copies plus 16 low bits each
// (`--master-weights split`), two bytes an element fewer on the device than an fp32 master beside
// its copy.
// Depends on core/ (split_f32, join_f32), ops/ (copies between devices), nn/ (compute copies).
// Keep: a split parameter's value is (copy, low) and nothing else; whoever reads or writes it
// outside AdamW's update takes a View.
//
// Note [Split masters]
// In a bf16 run every parameter a forward reads through its compute copy (Note [Compute copies],
// nn/compute_copy.h) is kept twice on the device: the fp32 master (4 bytes) and its bf16 rounding
// (2). The copy is already the master's top half, give or take one unit from the rounding, so the
// master is the copy plus the 16 bits below it (Note [Split fp32], core/split_f32.h): the copy rounds
// with ties away from zero, so that the low half fits an int16 and the pair gives back the master
// bit for bit. split() makes each accepted parameter's copy and low half from its fp32 value and
// points the parameter's storage at no bytes (its shape, dtype and device stay, as with masters on
// the host: offload/offload_adamw.h); AdamW's update (adamw_step_'s master_low, ops/optim.h) reads
// the master from the two halves and writes both back. The copy stays current by the compute copy
// rule: nothing writes the parameter, and AdamW re-stamps the copy after each update.
// What differs from an fp32 master: the copy rounds ties away from zero where to_dtype rounds them
// to even, one value in 65,536 and one bf16 unit; the masters, moments and gradients are computed
// exactly as AdamW computes them from the same inputs.
// View: while one lives, each split parameter's storage views an fp32 master on the CPU joined
// from its halves (checkpoints save and load through it: dist::Strategy::parameter_values); a
// master written through it (a load) is split back into the copy and low half when it ends. When
// the SplitMasters ends (with its dist::Strategy), each split parameter takes over its joined
// master on the CPU.
// Parameters split: those whose copy is current, bf16, contiguous and of their shape, and whose
// storage they alone view, whole. Embedding weights are looked up in fp32 (the caller leaves
// them out); they stay fp32 masters.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/tensor.h"
#include "blu/nn/compute_copy.h"
#include "blu/nn/module.h"

namespace blu::optim {

class SplitMasters {
 public:
  // Splits each parameter of `params` that `accept` takes and that qualifies (above). The low
  // halves of all of them are one device allocation.
  SplitMasters(const nn::NamedTensors& params, const nn::ComputeCopies& copies,
               const std::function<bool(const std::string&, const Tensor&)>& accept);
  SplitMasters(const SplitMasters&) = delete;
  SplitMasters& operator=(const SplitMasters&) = delete;
  ~SplitMasters();

  int64_t elements() const { return elements_; }  // the split parameters' elements
  // The low halves of `param` (u8, two bytes an element), undefined when it is not split.
  Tensor low(const Tensor& param) const;

  class View {
   public:
    explicit View(SplitMasters* s);  // null: nothing to view
    ~View();
    View(const View&) = delete;
    View& operator=(const View&) = delete;

   private:
    SplitMasters* s_;
  };
  View view() { return View(this); }

 private:
  struct Entry {
    Tensor param, low;
    std::shared_ptr<nn::ComputeCopy> copy;
    Tensor host;           // the fp32 master on the CPU while a View lives
    uint64_t version = 0;  // the parameter storage's version when the view began
  };
  void store(Entry& e, const Tensor& master);
  Tensor joined_on_host(const Entry& e) const;
  void begin_view();
  void end_view();
  std::vector<Entry> entries_;
  Tensor lows_;  // every low half, one buffer
  int64_t elements_ = 0;
  bool viewing_ = false;
};

}  // namespace blu::optim
