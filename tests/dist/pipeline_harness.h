// Pipeline-parallel training for the multi-process tests: scenario "pipeline" runs one rank of a
// pipeline (or, with one process and BLU_PP_MODE=single, the plain reference) of the tiny GPT-2
// (tied embedding) or the tiny Llama (untied) with BLU_PP_LAYERS blocks, through dist::Strategy's
// batch step — the same call on both paths. Every micro-batch is 4 rows × 16 tokens of the global
// batch. Settings (environment): BLU_PP_FAMILY gpt2|llama, _LAYERS, _MODE single|pipeline,
// _SCHEDULE gpipe|1f1b|interleaved, _CHUNKS, _MICRO, _SPLIT "3,1" (blocks per virtual stage), _EXEC
// scheduled|message, _STEPS, _DELAY_RANK/_DELAY_MS (a sleep before each forward on that rank),
// _KILL_RANK/_KILL_STEP (that rank exits in the middle of that step), _SAVE_DIR/_SAVE_AT,
// _RESUME_DIR, _TIMEOUT_MS; BLU_DIST_OUT the output prefix. Every rank writes
// <out>.rank<r>.safetensors (its trained parameters by global name) and <out>.rank<r>.order (the
// actions it ran, step after step); rank 0 writes <out>.losses. A surviving rank of a kill writes
// the error it got to <out>.rank<r>.error.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/strategy.h"
#include "blu/io/safetensors.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "common/tiny_gpt.h"
#include "train_harness.h"

namespace blu::dist::test {

inline constexpr int64_t kPipeRows = 4;

inline std::unique_ptr<models::CausalLM> tiny_model(const std::string& family, int64_t layers) {
  if (family == "gpt2") {
    models::GPTConfig c = ::blu::test::tiny_gpt();
    c.n_layer = layers;
    return std::make_unique<models::GPT>(c, 1234);
  }
  models::LlamaConfig c = models::LlamaConfig::preset("tiny");
  c.num_hidden_layers = layers;
  return std::make_unique<models::Llama>(c, 1234);
}

inline std::pair<Tensor, Tensor> pipe_batch(int64_t step, int64_t micro) {
  std::vector<double> in, tg;
  for (int64_t row = 0; row < kPipeRows; ++row)
    for (int64_t t = 0; t < kT; ++t) {
      in.push_back(token(step, micro, row, t));
      tg.push_back(token(step, micro, row, t + 1));
    }
  return {from_vector(in, {kPipeRows, kT}, DType::i32), from_vector(tg, {kPipeRows, kT}, DType::i32)};
}

// The one-rank pipeline the in-process tests (pipeline_test.cpp, cuda/pipeline_cuda_test.cpp)
// compare with the plain step: interleaved 1F1B, two chunks of 1 and 3 blocks, three micro-batches.
inline PipelineOptions one_rank_two_chunks() {
  PipelineOptions o;
  o.schedule = PipelineScheduleKind::interleaved;
  o.chunks = 2;
  o.micro_batches = 3;
  o.layers = {1, 3};
  return o;
}

// The largest |difference| between two models' parameters, pairwise in registration order, read
// on the host.
inline double max_param_diff(nn::Module& a, nn::Module& b) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  EXPECT_EQ(pa.size(), pb.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(pa.size(), pb.size()); ++i) {
    const std::vector<double> x = to_vector(to_device(pa[i].second, kCPU)), y = to_vector(to_device(pb[i].second, kCPU));
    for (size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::abs(x[j] - y[j]));
  }
  return worst;
}

inline std::vector<int64_t> parse_counts(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(std::stoll(item));
  return out;
}

inline void write_params(const std::string& path, const nn::NamedTensors& params) {
  SafeTensorsWriter w;
  for (const auto& [name, p] : params)
    w.add(name, p.dtype(), p.shape(), {static_cast<const std::byte*>(p.raw_data()), p.nbytes()});
  w.write(path);
}

// Bytes of the parameters the stage trains, each storage once.
inline int64_t owned_bytes(const PipelineStage& stage) {
  std::set<const Storage*> seen;
  int64_t n = 0;
  for (const auto& [name, p] : stage.owned_parameters())
    if (seen.insert(p.storage().get()).second) n += int64_t(p.storage()->nbytes());
  return n;
}

inline void pipeline_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const int r = env.rank, W = env.world_size;
  const std::string family = getenv_or("BLU_PP_FAMILY", "gpt2");
  const int64_t layers = std::stoll(getenv_or("BLU_PP_LAYERS", "4"));
  const bool single = getenv_or("BLU_PP_MODE", "pipeline") == "single";
  const int64_t micro = std::stoll(getenv_or("BLU_PP_MICRO", "4"));
  const int64_t steps = std::stoll(getenv_or("BLU_PP_STEPS", "10"));
  const int delay_rank = std::stoi(getenv_or("BLU_PP_DELAY_RANK", "-1"));
  const int delay_ms = std::stoi(getenv_or("BLU_PP_DELAY_MS", "0"));
  const int kill_rank = std::stoi(getenv_or("BLU_PP_KILL_RANK", "-1"));
  const int64_t kill_step = std::stoll(getenv_or("BLU_PP_KILL_STEP", "1"));
  const std::string save_dir = getenv_or("BLU_PP_SAVE_DIR", ""), resume_dir = getenv_or("BLU_PP_RESUME_DIR", "");
  const int64_t save_at = std::stoll(getenv_or("BLU_PP_SAVE_AT", "-1"));
  const std::string out = getenv_or("BLU_DIST_OUT", "");
  const auto timeout = std::chrono::milliseconds(std::stoll(getenv_or("BLU_PP_TIMEOUT_MS", "20000")));

  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  if (!single) {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, r == 0, 10000ms);
    pg = make_gloo_group(*store, r, W, GlooOptions{.timeout = timeout, .hostname = "", .prefix = "default_pg"});
  }
  std::unique_ptr<models::CausalLM> model = tiny_model(family, layers);
  const OptimizerConfig oc{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  int64_t step = 0;
  std::unique_ptr<Strategy> strategy;
  if (single) {
    strategy = std::make_unique<Strategy>(*model, nullptr, StrategyConfig{}, oc);
  } else {
    PipelineOptions po;
    po.schedule = parse_schedule_kind(getenv_or("BLU_PP_SCHEDULE", "1f1b"));
    po.chunks = std::stoi(getenv_or("BLU_PP_CHUNKS", "1"));
    po.micro_batches = micro;
    po.layers = parse_counts(getenv_or("BLU_PP_SPLIT", ""));
    po.execution = getenv_or("BLU_PP_EXEC", "message") == "scheduled" ? PipelineExecution::scheduled
                                                                     : PipelineExecution::message_driven;
    po.before_action = [&](const PipelineAction& a) {
      if (r == delay_rank && a.op == PipelineAction::forward) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      if (r == kill_rank && step == kill_step && a.op == PipelineAction::backward && a.micro == 1) {
        std::fflush(nullptr);
        ::_exit(0);  // exit 0, so the launcher lets the others report
      }
    };
    strategy = std::make_unique<Strategy>(*model, pg, po, StrategyConfig{}, oc);
    if (r == 0) std::printf("%s\n", strategy->describe().c_str());
    // A stage holds the bytes of the parameters it trains, and of no others.
    const int64_t resident = strategy->pipeline()->resident_parameter_bytes();
    EXPECT_EQ(resident, owned_bytes(*strategy->pipeline())) << "rank " << r;
    if (W > 1) {
      EXPECT_LT(resident, model->num_parameters() * 4) << "rank " << r;
    }
  }
  if (!resume_dir.empty()) {
    const std::string ckpt = strategy->latest_checkpoint(resume_dir);
    ASSERT_FALSE(ckpt.empty()) << "no checkpoint in " << resume_dir;
    step = strategy->load(ckpt, *model, model->config()).step;
  }
  std::vector<double> losses;
  std::ofstream order;
  if (!out.empty()) order.open(out + ".rank" + std::to_string(r) + ".order");
  try {
    for (; step < steps; ++step) {
      const StepValues v = strategy->step(micro, [&](int64_t m) { return pipe_batch(step % 3, m); }, 1e-2, 1.0);
      losses.push_back(strategy->read(v, false).loss);
      if (strategy->pipeline()) {
        for (const PipelineAction& a : strategy->pipeline()->last_order()) order << to_string(a) << ' ';
        order << "\n";
      }
      if (step + 1 == save_at) {
        TrainState st;
        st.step = step + 1;
        st.model_config = model->config();
        strategy->save(save_dir, *model, st, 0);
      }
    }
  } catch (const Error& e) {
    if (kill_rank < 0) throw;
    std::ofstream(out + ".rank" + std::to_string(r) + ".error") << e.what();
    std::printf("rank %d: %s\n", r, e.what());
    std::fflush(nullptr);
    ::_exit(0);  // the group's peer is gone: skip its destructor
  }
  ASSERT_LT(kill_rank, 0) << "rank " << r << " finished although rank " << kill_rank << " was killed";
  // The whole model's loss on one batch, as evaluation takes it: every parameter current on every
  // rank while the guard lives, the others' bytes given back after it.
  double eval_loss = 0;
  {
    const auto full = strategy->full_parameters();
    NoGradGuard no_grad;
    const auto [x, y] = pipe_batch(7, 0);
    eval_loss = to_vector(model->forward(x, y).loss)[0];
  }
  if (!single) {
    EXPECT_EQ(strategy->pipeline()->resident_parameter_bytes(), owned_bytes(*strategy->pipeline()));
  }
  if (!out.empty()) {
    std::ofstream ef(out + ".rank" + std::to_string(r) + ".eval");
    char eb[64];
    std::snprintf(eb, sizeof eb, "%.17g\n", eval_loss);
    ef << eb;
    nn::NamedTensors trained = single ? model->named_parameters() : strategy->pipeline()->owned_parameters();
    write_params(out + ".rank" + std::to_string(r) + ".safetensors", trained);
    if (r == 0) {
      std::ofstream lf(out + ".losses");
      char buf[64];
      for (double l : losses) {
        std::snprintf(buf, sizeof buf, "%.17g\n", l);
        lf << buf;
      }
    }
  }
  if (pg) pg->barrier()->wait();
}

}  // namespace blu::dist::test
