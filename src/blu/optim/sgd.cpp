// optim/sgd: torch.optim.SGD (dampening 0) — L2 weight decay added to the gradient, momentum
// buffer initialised to the first gradient, optional Nesterov — one sgd_step op per parameter.
#include <cmath>

#include "blu/core/grad_mode.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/optim/optimizer.h"
#include "blu/optim/state_io.h"

namespace blu::optim {

namespace {

constexpr const char* kName = "SGD";

class SGD final : public Optimizer {
 public:
  SGD(std::vector<ParamGroup> groups, SGDOptions opt) : opt_(opt) {
    BLU_CHECK(opt.lr >= 0 && std::isfinite(opt.lr), "SGD: lr must be finite and >= 0, got ", opt.lr);
    BLU_CHECK(opt.momentum >= 0 && std::isfinite(opt.momentum), "SGD: momentum must be finite and >= 0, got ",
              opt.momentum);
    BLU_CHECK(!opt.nesterov || opt.momentum > 0, "SGD: nesterov needs momentum > 0, got ", opt.momentum);
    groups_ = std::move(groups);
    lr_ = opt.lr;
    params_ = detail::flatten_groups(groups_, kName);
    buffers_.resize(params_.size());
  }

  void step(const NormGate& gate) override {
    NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const detail::ParamRef& p = params_[i];
      const Tensor g = detail::checked_grad(p, kName);
      if (!g.defined()) continue;
      const bool init = opt_.momentum != 0 && !buffers_[i].defined();
      // Under a gate the first update may be skipped and the next one then reads the buffer as
      // momentum * buf + d: it starts at zero.
      if (init) buffers_[i] = gate.defined() ? zeros_like(p.param) : empty_like(p.param);
      sgd_step_(p.param, g, buffers_[i],
                {.lr = lr_, .momentum = opt_.momentum, .weight_decay = p.weight_decay, .nesterov = opt_.nesterov,
                 .init_buffer = init},
                gate);
    }
    ++steps_;
  }

  nn::NamedTensors state() const override {
    nn::NamedTensors out;
    out.emplace_back("step", detail::count_tensor(steps_));
    for (size_t i = 0; i < params_.size(); ++i)
      if (buffers_[i].defined()) out.emplace_back("momentum_buffer." + params_[i].name, buffers_[i]);
    return out;
  }

  void load_state(const nn::NamedTensors& state) override {
    NoGradGuard no_grad;
    std::vector<detail::StateKind> kinds;
    if (opt_.momentum != 0) kinds.push_back({"momentum_buffer", false});
    detail::ParsedState parsed = detail::parse_state(state, params_, kinds, kName);
    std::vector<Tensor> next(params_.size());
    for (size_t i = 0; i < params_.size(); ++i)
      if (!parsed.per_param[i].empty()) next[i] = detail::f32_copy(parsed.per_param[i][0], params_[i].param);
    buffers_ = std::move(next);
    steps_ = parsed.step;
  }

 private:
  SGDOptions opt_;
  std::vector<detail::ParamRef> params_;
  std::vector<Tensor> buffers_;  // undefined until the parameter's first update (or momentum == 0)
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(std::vector<ParamGroup> groups, SGDOptions opt) {
  return std::make_unique<SGD>(std::move(groups), opt);
}

}  // namespace blu::optim
