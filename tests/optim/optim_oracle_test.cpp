// Optimizers and gradient clipping against PyTorch (tests/optim/torch_optim.py): the same initial
// parameters, per-step random gradients and learning rates go to both sides; parameters are
// compared after every step. One PyTorch process runs every case.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "blu/optim/optimizer.h"
#include "common/opinfo.h"
#include "common/torch_oracle.h"

namespace blu::test {
namespace {

using optim::LRSchedule;
using optim::ParamGroup;

// Odd shapes, two groups with different weight decay, a parameter that never gets a gradient
// ("frozen") and one that gets one only on even steps ("sometimes": its own step count drives
// its bias correction, as in PyTorch), one stored non-contiguously.
struct ParamSpec {
  std::string name;
  Shape shape;
  int group;
  enum { always, never, even_steps } grads;
  bool noncontiguous = false;
};
const std::vector<ParamSpec> kParams = {
    {"w1", {7, 5}, 0, ParamSpec::always},
    {"b1", {13}, 1, ParamSpec::always},
    {"w2", {3, 1, 4}, 0, ParamSpec::always},
    {"frozen", {1}, 1, ParamSpec::never},
    {"sometimes", {5, 3}, 0, ParamSpec::even_steps, true},
};
const double kWeightDecay[2] = {0.1, 0.0};
constexpr int kSteps = 10;

struct OptimCase {
  std::string id;
  nlohmann::json manifest;
  std::function<std::unique_ptr<optim::Optimizer>(std::vector<ParamGroup>)> make;
  std::vector<double> lr;
  std::vector<std::pair<std::string, Tensor>> params;           // live, updated by blu
  std::vector<Tensor> initial;                                   // their values before step 0
  std::vector<std::vector<std::pair<std::string, Tensor>>> got;  // snapshots after each step
  std::vector<std::vector<std::pair<std::string, Tensor>>> grads;  // per step (undefined: none)
};

bool has_grad(const ParamSpec& p, int step) {
  return p.grads == ParamSpec::always || (p.grads == ParamSpec::even_steps && step % 2 == 0);
}

void prepare(OptimCase& c, TorchOracle& oracle, Generator& gen) {
  nlohmann::json groups = nlohmann::json::array({{{"weight_decay", kWeightDecay[0]}, {"params", {}}},
                                                 {{"weight_decay", kWeightDecay[1]}, {"params", {}}}});
  for (const ParamSpec& s : kParams) {
    Tensor p = rnd(gen, s.shape, DType::f32);
    if (s.noncontiguous) p = noncontig(p);
    c.initial.push_back(clone(p));
    oracle.put(c.id + ".p." + s.name, c.initial.back());  // put() keeps a handle: p changes below
    p.set_requires_grad(true);
    c.params.emplace_back(s.name, p);
    groups[s.group]["params"].push_back(s.name);
  }
  for (int step = 0; step < kSteps; ++step) {
    c.grads.emplace_back();
    for (const ParamSpec& s : kParams) {
      Tensor g;
      if (has_grad(s, step)) {
        g = rnd(gen, s.shape, DType::f32);
        oracle.put(c.id + ".g" + std::to_string(step) + "." + s.name, g);
      }
      c.grads.back().emplace_back(s.name, g);
    }
  }
  c.manifest["id"] = c.id;
  c.manifest["groups"] = groups;
  c.manifest["lr"] = c.lr;
  c.manifest["steps"] = kSteps;
}

void run_blu(OptimCase& c) {
  std::vector<ParamGroup> groups(2);
  for (size_t i = 0; i < kParams.size(); ++i) {
    groups[kParams[i].group].params.push_back(c.params[i]);
    groups[kParams[i].group].weight_decay = kWeightDecay[kParams[i].group];
  }
  auto opt = c.make(groups);
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    for (size_t i = 0; i < kParams.size(); ++i)
      if (c.grads[step][i].second.defined()) c.params[i].second.set_grad(clone(c.grads[step][i].second));
    opt->set_lr(c.lr[step]);
    opt->step();
    c.got.emplace_back();
    for (auto& [name, p] : c.params) c.got.back().emplace_back(name, clone(p.detach()));
  }
  EXPECT_EQ(opt->steps(), kSteps);
}

std::vector<double> schedule_lrs(double max_lr) {
  LRSchedule s{.kind = LRSchedule::Kind::cosine, .max_lr = max_lr, .min_lr = max_lr / 10, .warmup_steps = 3,
               .total_steps = kSteps};
  std::vector<double> lr;
  for (int i = 0; i < kSteps; ++i) lr.push_back(s.at(i));
  return lr;
}

TEST(OptimOracle, AdamWAndSGDMatchPyTorchEveryStep) {
  TorchOracle oracle;
  Generator gen(1234);
  std::vector<OptimCase> cases(3);
  cases[0].id = "adamw";
  cases[0].lr = schedule_lrs(1e-2);
  cases[0].manifest = {{"opt", "adamw"}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}};
  cases[0].make = [](std::vector<ParamGroup> g) {
    return optim::make_adamw(std::move(g), {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  };
  cases[1].id = "sgd_momentum";
  cases[1].lr = schedule_lrs(0.1);
  cases[1].manifest = {{"opt", "sgd"}, {"momentum", 0.9}, {"nesterov", false}};
  cases[1].make = [](std::vector<ParamGroup> g) {
    return optim::make_sgd(std::move(g), {.lr = 0.1, .momentum = 0.9, .nesterov = false});
  };
  cases[2].id = "sgd_nesterov";
  cases[2].lr = schedule_lrs(0.1);
  cases[2].manifest = {{"opt", "sgd"}, {"momentum", 0.8}, {"nesterov", true}};
  cases[2].make = [](std::vector<ParamGroup> g) {
    return optim::make_sgd(std::move(g), {.lr = 0.1, .momentum = 0.8, .nesterov = true});
  };
  nlohmann::json manifest = {{"optim", nlohmann::json::array()}, {"clip", nlohmann::json::array()}};
  for (OptimCase& c : cases) {
    prepare(c, oracle, gen);
    run_blu(c);
    manifest["optim"].push_back(c.manifest);
  }
  auto results = oracle.run("optim/torch_optim.py", manifest);
  for (OptimCase& c : cases) {
    for (int step = 0; step < kSteps; ++step) {
      for (auto& [name, got] : c.got[step]) {
        SCOPED_TRACE(c.id + " step " + std::to_string(step) + " param " + name);
        // 1e-6 relative; 1e-7 absolute for elements that pass near zero.
        EXPECT_EQ(compare(got, results.get(c.id + ".p" + std::to_string(step) + "." + name), 1e-7, 1e-6), "");
      }
    }
    // The parameter without gradients is untouched (no weight decay either).
    EXPECT_EQ(compare(c.got.back()[3].second, c.initial[3], 0, 0), "") << c.id;
  }
}

TEST(OptimOracle, ClipGradNormMatchesPyTorch) {
  TorchOracle oracle;
  Generator gen(77);
  const std::vector<std::pair<std::string, Shape>> shapes = {{"a", {4, 6}}, {"b", {9}}, {"c", {2, 3, 5}}};
  const std::vector<double> max_norms = {0.5, 1e3};  // clips / leaves alone
  std::vector<std::vector<Tensor>> params(max_norms.size());
  std::vector<double> norms;
  nlohmann::json manifest = {{"optim", nlohmann::json::array()}, {"clip", nlohmann::json::array()}};
  for (size_t k = 0; k < max_norms.size(); ++k) {
    const std::string id = "clip" + std::to_string(k);
    nlohmann::json names = nlohmann::json::array();
    for (auto& [name, shape] : shapes) {
      Tensor p = zeros(shape);
      p.set_requires_grad(true);
      Tensor g = rnd(gen, shape, DType::f32);
      oracle.put(id + ".g." + name, g);
      p.set_grad(clone(g));
      params[k].push_back(p);
      names.push_back(name);
    }
    Tensor without_grad = zeros({3});  // skipped, like PyTorch's parameters whose grad is None
    without_grad.set_requires_grad(true);
    params[k].push_back(without_grad);
    norms.push_back(optim::clip_grad_norm(params[k], max_norms[k]));
    manifest["clip"].push_back({{"id", id}, {"names", names}, {"max_norm", max_norms[k]}});
  }
  auto results = oracle.run("optim/torch_optim.py", manifest);
  for (size_t k = 0; k < max_norms.size(); ++k) {
    const std::string id = "clip" + std::to_string(k);
    SCOPED_TRACE(id);
    // PyTorch accumulates the norm in fp32, we in double.
    EXPECT_NEAR(norms[k], results.get(id + ".norm").item(), 1e-6 * norms[k]);
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_EQ(compare(params[k][i].grad(), results.get(id + ".g." + shapes[i].first), 1e-7, 1e-6), "")
          << shapes[i].first;
    EXPECT_FALSE(params[k].back().grad().defined());
  }
}

}  // namespace
}  // namespace blu::test
