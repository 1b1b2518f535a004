// optim/adamw: torch.optim.AdamW — decoupled weight decay, bias-corrected moments, a step count
// per parameter — as few adamw_step ops as the coefficients allow (ops/optim.h): one per
// (weight decay, step count, compute-copy dtype, split master), each over all the parameters that
// share them.
#include <cmath>
#include <map>
#include <tuple>

#include "blu/core/grad_mode.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/optim/master_split.h"
#include "blu/optim/optimizer.h"
#include "blu/optim/state_io.h"

namespace blu::optim {

namespace {

constexpr const char* kName = "AdamW";

class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, AdamWOptions opt) : opt_(opt) {
    BLU_CHECK(opt.lr >= 0 && std::isfinite(opt.lr), "AdamW: lr must be finite and >= 0, got ", opt.lr);
    BLU_CHECK(opt.beta1 >= 0 && opt.beta1 < 1, "AdamW: beta1 must be in [0, 1), got ", opt.beta1);
    BLU_CHECK(opt.beta2 >= 0 && opt.beta2 < 1, "AdamW: beta2 must be in [0, 1), got ", opt.beta2);
    BLU_CHECK(opt.eps >= 0, "AdamW: eps must be >= 0, got ", opt.eps);
    check_state_dtype(opt.state_dtype, kName);
    groups_ = std::move(groups);
    lr_ = opt.lr;
    params_ = detail::flatten_groups(groups_, kName);
    state_.resize(params_.size());
    copies_.resize(params_.size());
  }

  void step(const NormGate& gate) override {
    NoGradGuard no_grad;
    // Parameters with equal coefficients go into one op; map order keeps the ops deterministic.
    std::map<std::tuple<double, int64_t, DType, bool>, std::vector<AdamWTensors>> batches;
    std::vector<size_t> copies_written;
    make_state();
    for (size_t i = 0; i < params_.size(); ++i) {
      const detail::ParamRef& p = params_[i];
      const Tensor g = detail::checked_grad(p, kName);
      if (!g.defined()) continue;
      State& s = state_[i];
      ++s.step;
      const Tensor copy = copies_[i] ? copies_[i]->target(p.param) : Tensor();
      if (copy.defined()) copies_written.push_back(i);
      const Tensor low = lows_.empty() ? Tensor() : lows_[i];
      BLU_ASSERT(!low.defined() || copy.defined(), kName, ": split parameter '", p.name, "' lost its compute copy");
      batches[{p.weight_decay, s.step, copy.defined() ? copy.dtype() : DType::f32, low.defined()}].push_back(
          {p.param, g, s.exp_avg, s.exp_avg_sq, copy, low});
    }
    for (const auto& [key, tensors] : batches)
      adamw_step_(tensors, {.lr = lr_, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps,
                            .weight_decay = std::get<0>(key), .step = std::get<1>(key)},
                  gate);
    // After all the ops: parameters viewing one storage are current only once all are written.
    for (size_t i : copies_written) copies_[i]->mark_written(params_[i].param);
    ++steps_;
  }

  void attach_compute_copies(const nn::ComputeCopies& copies) override {
    for (size_t i = 0; i < params_.size(); ++i)
      for (const auto& [t, c] : copies)
        if (t.is_same(params_[i].param)) copies_[i] = c;
  }

  void attach_split_masters(std::shared_ptr<const SplitMasters> masters) override {
    lows_.assign(params_.size(), Tensor());
    for (size_t i = 0; i < params_.size(); ++i) lows_[i] = masters->low(params_[i].param);
    masters_ = std::move(masters);
  }

  nn::NamedTensors state() const override {
    nn::NamedTensors out;
    out.emplace_back("step", detail::count_tensor(steps_));
    for (size_t i = 0; i < params_.size(); ++i) {
      const State& s = state_[i];
      if (s.step == 0) continue;
      out.emplace_back("exp_avg." + params_[i].name, s.exp_avg);
      out.emplace_back("exp_avg_sq." + params_[i].name, s.exp_avg_sq);
      out.emplace_back("step." + params_[i].name, detail::count_tensor(s.step));
    }
    return out;
  }

  void load_state(const nn::NamedTensors& state) override {
    NoGradGuard no_grad;
    detail::ParsedState parsed = detail::parse_state(
        state, params_, {{"exp_avg", false}, {"exp_avg_sq", false}, {"step", true}}, kName);
    std::vector<State> next(params_.size());
    std::vector<size_t> loaded;
    std::vector<Tensor> likes, avg, avg_sq;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& t = parsed.per_param[i];
      if (t.empty()) continue;
      const std::string& name = params_[i].name;
      next[i].step = detail::read_count(t[2], "step." + name);
      BLU_CHECK(next[i].step > 0, "AdamW state: 'step.", name, "' is 0 but moments are present");
      loaded.push_back(i);
      likes.push_back(like(i));
      avg.push_back(t[0]);
      avg_sq.push_back(t[1]);
    }
    const std::vector<Tensor> m = detail::packed_copies(avg, likes, "AdamW exp_avg", opt_.state_dtype),
                              v = detail::packed_copies(avg_sq, likes, "AdamW exp_avg_sq", opt_.state_dtype);
    for (size_t k = 0; k < loaded.size(); ++k) {
      next[loaded[k]].exp_avg = m[k];
      next[loaded[k]].exp_avg_sq = v[k];
    }
    state_ = std::move(next);
    steps_ = parsed.step;
  }

 private:
  // The moments of every parameter that has a gradient and no state yet, in one allocation per
  // moment (Note [Optimizer state in one buffer]).
  void make_state() {
    std::vector<size_t> fresh;
    std::vector<Tensor> likes;
    for (size_t i = 0; i < params_.size(); ++i)
      if (state_[i].step == 0 && params_[i].param.grad().defined()) {
        fresh.push_back(i);
        likes.push_back(like(i));
      }
    if (fresh.empty()) return;
    const std::vector<Tensor> m = detail::packed_zeros(likes, "AdamW exp_avg", opt_.state_dtype),
                              v = detail::packed_zeros(likes, "AdamW exp_avg_sq", opt_.state_dtype);
    for (size_t k = 0; k < fresh.size(); ++k) {
      state_[fresh[k]].exp_avg = m[k];
      state_[fresh[k]].exp_avg_sq = v[k];
    }
  }

  // What parameter i's moments are shaped and placed like: the parameter, or a split one's compute
  // copy (while a view of the values is open, the parameter's storage is on the CPU).
  Tensor like(size_t i) const {
    return lows_.empty() || !lows_[i].defined() ? params_[i].param : copies_[i]->tensor();
  }

  struct State {
    Tensor exp_avg, exp_avg_sq;
    int64_t step = 0;  // updates this parameter has had (0: no state yet)
  };
  AdamWOptions opt_;
  std::vector<detail::ParamRef> params_;
  std::vector<State> state_;
  std::vector<std::shared_ptr<nn::ComputeCopy>> copies_;  // null: none attached
  // Split masters: each parameter's low halves (undefined: an fp32 master), empty when none.
  std::vector<Tensor> lows_;
  std::shared_ptr<const SplitMasters> masters_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw(std::vector<ParamGroup> groups, AdamWOptions opt) {
  return std::make_unique<AdamW>(std::move(groups), opt);
}

}  // namespace blu::optim
