// train/trainer: running a training job — steps (eager, compiled or under a strategy),
// evaluation, samples, checkpoints and the end-of-run summary. The constructor, which builds the
// job from its options, is trainer_setup.cpp.
#include "blu/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <ostream>
#include <thread>

#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/annotations.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/planner.h"
#include "blu/core/rng.h"
#include "blu/dist/strategy.h"
#include "blu/dist/consistency.h"
#include "blu/dist/tcp_store.h"
#include "blu/dist/env.h"
#include "blu/dist/hetero.h"
#include "blu/dist/mesh.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/zero.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/train/layout_setup.h"
#include "blu/io/checkpoint.h"
#include "blu/io/json_file.h"
#include "blu/offload/plan.h"
#include "blu/ops/precision.h"
#include "blu/memory/allocator.h"
#include "blu/memory/caching_allocator.h"
#include "blu/memory/device_pool.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"
#include "blu/models/registry.h"
#include "blu/train/model_spec.h"
#include "blu/train/peak_flops.h"
#include "blu/train/run_dir.h"
#include "blu/train/run_record.h"
#ifdef BLU_HAVE_CUDA
#include "blu/backend/cuda/runtime.h"
#endif

namespace blu::train {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// [B, T] int32 ids on `device` (a host tensor first; one to_device when the device is not the CPU).
Tensor ids_tensor(const std::vector<int32_t>& ids, int64_t B, int64_t T, Device device) {
  BLU_ASSERT(int64_t(ids.size()) == B * T, "batch holds ", ids.size(), " ids, expected ", B * T);
  Tensor host = empty({B, T}, DType::i32, kCPU);
  std::memcpy(host.data<int32_t>(), ids.data(), ids.size() * sizeof(int32_t));
  return device == kCPU ? host : to_device(host, device);  // copy_ stays on one device
}

// The value of a one-element tensor on any device.
double scalar_value(const Tensor& t) {
  return t.device().is_cpu() ? t.item() : to_device(t, kCPU).item();
}

// A delay (ms, from BLU_TEST_RANK0_DELAY_MS) that rank 0 adds to its checkpoints and samples:
// tests use it to make rank 0 slower than the collectives' timeout.
void test_delay_on_rank0(int rank) {
  static const char* v = std::getenv("BLU_TEST_RANK0_DELAY_MS");
  if (rank == 0 && v && *v) std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(v)));
}

// A rank that stops answering: BLU_TEST_STALL="RANK:STEP" makes that rank sleep (an hour, not
// interrupted by signals) before training step STEP, as a hung rank would. Tests of the collectives'
// timeout and the flight recorder use it.
void test_stall(int rank, int64_t step) {
  static const char* v = std::getenv("BLU_TEST_STALL");
  if (!v || !*v) return;
  int r = -1;
  long long s = -1;
  if (std::sscanf(v, "%d:%lld", &r, &s) == 2 && r == rank && s == step)
    std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace

std::string resolve_checkpoint(const std::string& path) {
  BLU_CHECK(!path.empty(), "expected a checkpoint file or a run directory, got an empty path");
  if (fs::is_directory(path)) {
    std::string reasons;
    const std::string latest = latest_valid_checkpoint(path, [&](const std::string& w) {
      reasons += "\n  " + w;
      std::cerr << w << "\n";
    });
    BLU_CHECK(!latest.empty(), "expected checkpoints (ckpt_*.safetensors) in the run directory ", path,
              reasons.empty() ? std::string(", found none") : ", none verifies:" + reasons);
    return latest;
  }
  BLU_CHECK(fs::is_regular_file(path), "checkpoint not found: expected a file or a run directory, got '", path, "'");
  return path;
}

double evaluate(models::CausalLM& model, DataLoader& loader, int64_t batches, Device device) {
  const int64_t n = std::min(batches, loader.batches_per_epoch());
  BLU_CHECK(n > 0, "evaluation needs at least one batch: asked for ", batches, ", the data holds ",
            loader.batches_per_epoch(), " batches of ", loader.B(), "x", loader.T(), " tokens");
  NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  loader.reset();
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Batch b = loader.next();
    const auto out = model.forward(ids_tensor(b.inputs, loader.B(), loader.T(), device),
                                   ids_tensor(b.targets, loader.B(), loader.T(), device));
    sum += scalar_value(out.loss);
  }
  model.train(was_training);
  return sum / double(n);
}

Trainer::~Trainer() = default;

void Trainer::compute_baseline() {
  const TrainOptions& o = opt_s_;
  if (!o.baseline || !val_loader_) return;
  const int64_t V = o.baseline_vocab > 0 ? o.baseline_vocab : model_->vocab_size();
  const NgramCounts counts(train_loader_->files(), int32_t(V), o.baseline_max_tokens);
  BaselineLoss b = baseline_loss(counts, *val_loader_, o.val_batches);
  b.unigram = strategy_->mean_over_ranks(b.unigram);
  b.bigram = strategy_->mean_over_ranks(b.bigram);
  baseline_ = b;
  baseline_train_tokens_ = counts.tokens();
  metrics_.write({{"event", "baseline"},
                  {"step", step_},
                  {"unigram_loss", b.unigram},
                  {"bigram_loss", b.bigram},
                  {"smoothing", "add-one"},
                  {"vocab", V},
                  {"train_tokens", counts.tokens()},
                  {"val_tokens", b.tokens}});
}

void Trainer::print_header() {
  if (!cb_.log) return;
  std::ostream& os = *cb_.log;
  const TrainOptions& o = opt_s_;
  os << "config:\n" << o.to_json().dump(2) << "\n\n";
  print_parameter_table(os, model_->named_parameters());
  os << "\ndata: " << train_loader_->files().size() << " train shard(s), " << train_loader_->batches_per_epoch()
     << " batches per epoch";
  if (val_loader_) os << "; " << val_loader_->files().size() << " val shard(s)";
  os << "\ntokens per step: " << format_count(o.batch_size * o.seq_len * o.grad_accum) << " (B " << o.batch_size
     << " x T " << o.seq_len << " x grad_accum " << o.grad_accum << ")\n";
  os << "device: " << device_.str() << ", optimizer: " << o.optimizer << ", schedule: " << o.schedule
     << " (warmup " << o.warmup << ")\n";
  if (baseline_) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "baseline: val loss of n-gram counts: unigram %.4f, bigram %.4f", baseline_->unigram,
                  baseline_->bigram);
    os << buf << " (add-one smoothing, " << format_count(baseline_train_tokens_) << " train tokens counted, "
       << format_count(baseline_->tokens) << " val tokens scored)\n";
  }
  if (!layout_text_.empty()) {  // every --parallel run says what it runs
    os << "parallel layout: " << layout_text_ << " over " << world_ << " ranks: " << strategy_->describe() << "\n";
    os << "rows per replica:";
    for (int64_t r : replica_rows_) os << " " << r;
    os << " (a global batch of " << o.batch_size * int64_t(replica_rows_.size()) << " rows; tokens per step "
       << format_count(o.batch_size * o.seq_len * o.grad_accum * o.dp) << ")\n";
  }
  if (pipelined_ && !mesh_)
    os << "pipeline parallel: " << strategy_->describe() << " over " << world_ << " ranks\n";
  else if (o.dp > 1 && !mesh_)
    os << "data parallel: " << strategy_->describe()
       << "; batch per rank " << o.batch_size << ", tokens per step across ranks "
       << format_count(o.batch_size * o.seq_len * o.grad_accum * o.dp) << "\n";
  os << "\n";
  os.flush();
}

void apply_precision(models::CausalLM& model, const std::string& precision) {
  if (precision == "fp32" || precision == "tf32") {
    set_matmul_precision(precision == "tf32" ? "tf32" : "ieee");
  } else if (precision == "bf16") {
    model.set_compute_dtype(DType::bf16);
  } else if (precision == "fp16") {
    model.set_compute_dtype(DType::f16);
  } else {
    BLU_CHECK(false, "unknown precision '", precision, "' (expected fp32, tf32, bf16 or fp16)");
  }
}

// --parallel auto, after the first steps: the planner's prediction for the layout it picked against
// the step time of the second logged line (the steps after the first: set-up and warm-up stay
// out) and the largest allocator peak over the ranks since the line before (gathered through the
// store; every rank reads the same steps, so every rank gets here), with the errors as bench
// --parallel reports them: (predicted − measured) / measured.
void Trainer::check_auto_prediction(const StepStats& s) {
  double peak = double(s.mem_bytes);
  if (store_ && world_ > 1) {
    const std::string key = "parallel_auto_peak/" + std::to_string(rank_);
    store_->set(key, std::to_string(s.mem_bytes));
    if (rank_ == 0)
      for (int r = 1; r < world_; ++r) peak = std::max(peak, std::stod(store_->get("parallel_auto_peak/" + std::to_string(r))));
  }
  if (rank_ != 0) return;
  const double pred_ms = (*auto_prediction_)["step_ms"].get<double>();
  const double pred_mib = (*auto_prediction_)["memory_mib"].get<double>(), mib = peak / double(1 << 20);
  const double e_step = (pred_ms - s.ms) / s.ms, e_mem = (pred_mib - mib) / mib;
  metrics_.write({{"event", "parallel_auto"}, {"step", s.step}, {"layout", (*auto_prediction_)["layout"]},
                  {"predicted_ms", pred_ms}, {"predicted_mib", pred_mib}, {"ms", s.ms}, {"mib", mib},
                  {"error_step", e_step}, {"error_memory", e_mem}});
  if (cb_.log) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "parallel auto: measured %.2f ms a step and %.1f MiB on the most loaded rank; predicted %.2f ms "
                  "and %.1f MiB (error %+.1f%% and %+.1f%%)\n",
                  s.ms, mib, pred_ms, pred_mib, 100 * e_step, 100 * e_mem);
    *cb_.log << buf;
  }
}

dist::StepValues Trainer::train_step() {
  const TrainOptions& o = opt_s_;
  // Only the loss is kept: with no handle left on the logits, cross-entropy's backward writes
  // their gradient over them (Note [Donated buffers], ops/dispatch.h).
  const auto loss_of = [&](int64_t) {
    const Batch b = train_loader_->next();
    return model_->forward(ids_tensor(b.inputs, local_batch_, o.seq_len, device_),
                           ids_tensor(b.targets, local_batch_, o.seq_len, device_))
        .loss;
  };
  if (pipelined_) {  // the stages run the micro-batches' forwards and backwards by the schedule
    // The step's batches are read once, in order; the stage may ask for micro-batch i more than
    // once (its shape first, then its ids or targets).
    std::vector<std::pair<Tensor, Tensor>> batches;
    for (int64_t i = 0; i < o.grad_accum; ++i) {
      const Batch b = train_loader_->next();
      batches.emplace_back(ids_tensor(b.inputs, local_batch_, o.seq_len, device_),
                           ids_tensor(b.targets, local_batch_, o.seq_len, device_));
    }
    return strategy_->step(o.grad_accum, [&](int64_t i) { return batches.at(size_t(i)); }, schedule_.at(step_),
                           o.grad_clip);
  }
  if (compiled_) {
    // The batches are read before the capture, into the same tensors every step (step inputs of
    // the compiled step); the step itself is Strategy::step, compiled.
    for (int64_t i = 0; i < o.grad_accum; ++i) {
      const Batch b = train_loader_->next();
      NoGradGuard no_grad;
      copy_(compile_inputs_[size_t(2 * i)], ids_tensor(b.inputs, o.batch_size, o.seq_len, device_));
      copy_(compile_inputs_[size_t(2 * i + 1)], ids_tensor(b.targets, o.batch_size, o.seq_len, device_));
    }
    dist::StepValues v;
    const double lr = schedule_.at(step_);
    // Note [The warm-up step recomputes every block] (models/activations.h).
    const models::WarmupPolicy warmup(*model_, compiled_->warming_up() && opt_s_.compile_remat);
    compiled_->run(compile_inputs_, [&] {
      v = strategy_->step(o.grad_accum, [&](int64_t i) {
        return std::pair<Tensor, Tensor>{compile_inputs_[size_t(2 * i)], compile_inputs_[size_t(2 * i + 1)]};
      }, lr, o.grad_clip);
      // The next step drops the gradients before its forward anyway; dropped inside the captured
      // step they are its temporaries, which the plan packs into the bytes the activations free
      // in backward, instead of step outputs beside the arena.
      strategy_->optimizer().zero_grad();
    });
    return v;
  }
  return strategy_->step(o.grad_accum, loss_of, schedule_.at(step_), o.grad_clip);
}

void Trainer::sample(int64_t step) {
  const int64_t n = opt_s_.sample_tokens;  // past the block size, generate() slides the window
  // Its own generator, seeded from (seed, step): sampling never moves the training stream.
  Generator gen(opt_s_.seed * 1000003ull + uint64_t(step), 0);
  std::vector<int32_t> ids;
  {
    NoGradGuard no_grad;
    model_->eval();
    std::vector<int32_t> prompt = cb_.sample_prompt;
    if (prompt.empty()) prompt.push_back(model_->vocab_size() > 50256 ? 50256 : 0);
    ids = model_->generate(prompt, n, opt_s_.sample_temperature, opt_s_.sample_top_k, gen);  // new tokens
    model_->train();
  }
  std::string text;
  if (cb_.decode) {
    text = cb_.decode(ids);
  } else {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) text += ' ';
      text += std::to_string(ids[i]);
    }
  }
  if (cb_.log) *cb_.log << "--- sample at step " << step << " ---\n" << text << "\n---\n";
  metrics_.write({{"event", "sample"}, {"step", step}, {"text", text}});
}

std::string Trainer::save(int64_t step) {
  if (opt_s_.out.empty()) return "";
  TrainState st;
  st.step = step;
  st.rng_seed = default_generator().seed();
  st.rng_offset = default_generator().offset();
  st.loader = train_loader_->state();
  st.model_config = opt_s_.model;
  st.run = opt_s_.to_json();
  std::string written;
  // Writing takes as long as the disk does: the collectives inside a sharded save get the work
  // timeout, and the other ranks wait for rank 0's file behind a store barrier.
  set_phase("the checkpoint at step " + std::to_string(step));
  with_work_timeout([&] {
    written = strategy_->save(opt_s_.out, *model_, st, int(opt_s_.keep_last));
    test_delay_on_rank0(rank_);
  });
  wait_for_rank0("rank 0's checkpoint at step " + std::to_string(step));
  if (written.empty()) return "";  // the model is replicated: rank 0's file is the checkpoint
  last_checkpoint_ = written;
  metrics_.write({{"event", "checkpoint"}, {"step", step}, {"path", last_checkpoint_}});
  if (cb_.log) *cb_.log << "checkpoint: " << last_checkpoint_ << "\n";
  return last_checkpoint_;
}

void Trainer::set_phase(const std::string& phase) {
  if (dist::ProcessGroup* pg = strategy_->process_group()) pg->set_phase(phase);
}

void Trainer::wait_for_rank0(const std::string& what) {
  if (!store_) return;
  dist::store_barrier(*store_, "trainer/work/" + std::to_string(++work_barriers_), world_,
                      dist::Milliseconds(int64_t(opt_s_.dist_work_timeout * 1000)), what);
}

void Trainer::with_work_timeout(const std::function<void()>& f) {
  dist::ProcessGroup* pg = strategy_->process_group();
  if (!pg) return f();
  const auto saved = pg->timeout();
  pg->set_timeout(std::max(saved, dist::Milliseconds(int64_t(opt_s_.dist_work_timeout * 1000))));
  try {
    f();
  } catch (...) {
    pg->set_timeout(saved);
    throw;
  }
  pg->set_timeout(saved);
}

void Trainer::keep_best(double val_loss) {
  if (opt_s_.out.empty() || rank_ != 0 || last_checkpoint_.empty()) return;
  // Copy, then rename: a reader never sees half a file under the final name.
  const fs::path best = fs::path(opt_s_.out) / kBestCheckpoint;
  const fs::path tmp = fs::path(opt_s_.out) / (std::string(".") + kBestCheckpoint + ".tmp");
  fs::copy_file(last_checkpoint_, tmp, fs::copy_options::overwrite_existing);
  fs::rename(tmp, best);
  metrics_.write({{"event", "best"}, {"step", step_}, {"val_loss", val_loss}, {"path", best.string()}});
}

TrainSummary Trainer::run() {
  const TrainOptions& o = opt_s_;
  TrainSummary sum;
  sum.start_step = step_;
  if (step_ >= o.steps && cb_.log)
    *cb_.log << "the run in " << o.out << " finished at step " << step_ << " of --steps " << o.steps
             << ": nothing left to train; pass a larger --steps to continue it\n";
  compute_baseline();
  if (baseline_) {
    sum.baseline_unigram = baseline_->unigram;
    sum.baseline_bigram = baseline_->bigram;
  }
  print_header();
  Allocator& alloc = allocator_for(device_);
  const auto t_run = Clock::now();
  int64_t last_eval = -1, last_save = last_checkpoint_.empty() ? -1 : step_;
  const auto run_eval = [&] {
    set_phase("validation at step " + std::to_string(step_));
    double v = 0;
    {
      const auto full = strategy_->full_parameters();  // ZeRO-3: the whole model for the evaluation
      v = evaluate(*model_, *val_loader_, o.val_batches, device_);
    }
    with_work_timeout([&] { v = strategy_->mean_over_ranks(v); });  // the ranks may finish apart
    last_eval = step_;
    sum.final_val_loss = v;
    nlohmann::json ev = {{"event", "eval"}, {"step", step_}, {"val_loss", v}};
    if (baseline_) {
      ev["bigram_loss"] = baseline_->bigram;
      ev["unigram_loss"] = baseline_->unigram;
    }
    metrics_.write(ev);
    if (cb_.log) {
      char buf[160];
      const int w = std::snprintf(buf, sizeof buf, "val   %lld | val loss %.4f", static_cast<long long>(step_), v);
      if (baseline_ && w > 0)
        std::snprintf(buf + w, sizeof buf - size_t(w), " | bigram %.4f (%+.4f) | unigram %.4f", baseline_->bigram,
                      v - baseline_->bigram, baseline_->unigram);
      *cb_.log << buf << "\n" << std::flush;
    }
    if (o.keep_best && v < best_val_) {
      best_val_ = v;
      if (last_save != step_) {
        save(step_);
        last_save = step_;
      }
      keep_best(v);
    }
    if (cb_.on_eval) cb_.on_eval(step_, v);
  };

  // A step's loss and norm stay on the device until a logged step reads them (Strategy::read: one
  // host read, and with several ranks one small collective that also combines the stop flags).
  // Steps that evaluate, sample or checkpoint, the first and the last are logged steps too; the
  // time and tokens of a logged step's line are the averages since the previous one.
  auto t_read = Clock::now();
  int64_t since_read = 0;
  alloc.reset_peak();
  while (step_ < o.steps) {
    if (store_) set_phase("training step " + std::to_string(step_ + 1));
    test_stall(rank_, step_ + 1);
    const dist::StepValues v = train_step();
    ++step_;
    ++since_read;
    const bool local_stop = cb_.stop && cb_.stop->load();
    const bool read = step_ % o.log_every == 0 || step_ == o.steps || step_ == sum.start_step + 1 ||
                      (o.val_every > 0 && step_ % o.val_every == 0) ||
                      (o.sample_every > 0 && step_ % o.sample_every == 0) ||
                      (o.ckpt_every > 0 && step_ % o.ckpt_every == 0) || (local_stop && !strategy_->process_group());
    const int64_t step_tokens = o.batch_size * o.seq_len * o.grad_accum * o.dp;  // all replicas
    sum.tokens += step_tokens;
    if (!read) continue;
    const dist::StepReadout r = strategy_->read(v, local_stop);
    if (!std::isfinite(r.grad_norm) && cb_.log) {  // the gate skipped the update on the device
      if (r.fp16_skipped >= 0)
        *cb_.log << "fp16: gradient overflow at step " << step_ << "; update skipped (" << r.fp16_skipped
                 << " so far), the loss scale backed off\n";
      else
        *cb_.log << "warning: gradient norm is " << r.grad_norm << " at step " << step_ << "; update skipped\n";
    }
    StepStats s;
    s.total_steps = o.steps;
    s.step = step_;
    s.loss = r.loss;
    s.grad_norm = r.grad_norm;
    s.lr = v.lr;
    if (r.fp16_skipped >= 0) s.skipped = r.fp16_skipped;
    s.ms = seconds_since(t_read) * 1e3 / double(since_read);
    s.tokens = step_tokens;  // mem_bytes is this rank's
    s.tokens_per_s = double(s.tokens) / (s.ms / 1e3);
    s.mem_bytes = alloc.stats().peak_bytes;
    s.elapsed_s = seconds_since(t_run);
    if (step_ < o.steps) s.eta_s = s.elapsed_s / double(step_ - sum.start_step) * double(o.steps - step_);
    if (peak_tflops_ > 0)
      s.mfu = s.tokens_per_s / double(world_) * model_->flops_per_token(o.seq_len) / (peak_tflops_ * 1e12);
    alloc.reset_peak();
    since_read = 0;
    sum.peak_mem_bytes = std::max(sum.peak_mem_bytes, s.mem_bytes);
    sum.final_train_loss = s.loss;
    nlohmann::json step_ev = {{"event", "step"},   {"step", s.step},       {"loss", s.loss},
                              {"lr", s.lr},        {"norm", s.grad_norm},  {"ms", s.ms},
                              {"tok_per_s", s.tokens_per_s}, {"mem_bytes", s.mem_bytes}};
    if (s.mfu > 0) step_ev["mfu"] = s.mfu;
    metrics_.write(step_ev);
    if (cb_.on_step) cb_.on_step(s);
    // Every rank saw the same flags in read(), so the ranks stop at the same step; alone, a stop
    // asked for during on_step counts at once.
    const bool stopping = r.stop || (!strategy_->process_group() && cb_.stop && cb_.stop->load());
    if (cb_.log) *cb_.log << format_progress_line(s) << "\n" << std::flush;
    if (auto_prediction_ && ++auto_reads_ == 2) check_auto_prediction(s);

    if (val_loader_ && o.val_every > 0 && step_ % o.val_every == 0) run_eval();
    if (o.sample_every > 0 && step_ % o.sample_every == 0 && !stopping) {
      {
        const auto full = strategy_->full_parameters();  // every rank takes part under ZeRO-3
        if (samples_here_) {  // rank 0, and under tensor parallelism the rest of its TP group
          sample(step_);
          test_delay_on_rank0(rank_);
        }
      }
      wait_for_rank0("rank 0's sample at step " + std::to_string(step_));
    }
    if (o.ckpt_every > 0 && step_ % o.ckpt_every == 0 && step_ < o.steps) {
      save(step_);
      last_save = step_;
    }
    // The next line's time per step starts here: validation, samples and checkpoints stay out of
    // its tok/s (they are in the elapsed time).
    t_read = Clock::now();
    if (stopping && step_ < o.steps) {
      sum.interrupted = true;
      if (cb_.log) *cb_.log << "stop requested: finishing at step " << step_ << "\n";
      break;
    }
  }
  strategy_->finish_update();  // the last update, when it runs behind the forward (offload/offload_adamw.h)
  if (val_loader_ && last_eval != step_ && !sum.interrupted) run_eval();
  if (last_save != step_) save(step_);
  if (compiled_) {  // how the steps ran: compiled, eager (warm-up, past the variant limit), fallback
    const auto& c = compiled_->counts();
    nlohmann::json ev = {{"event", "compile"}, {"step", step_},           {"compiled", c.compiled},
                         {"eager", c.eager},   {"fallback", c.fallback}, {"guard_failures", c.guard_failures},
                         {"streamed", c.streamed},
                         {"variants", compiled_->variants().size()}};
    if (!compiled_->variants().empty()) {
      const compiler::Variant& v = *compiled_->variants()[0];
      ev["graph_ops"] = v.graph.ops.size();
      ev["collectives"] = std::count_if(v.graph.ops.begin(), v.graph.ops.end(),
                                        [](const compiler::Op& op) { return op.kind == compiler::OpKind::collective; });
      ev["plan_peak_bytes"] = v.runtime->plan().peak_bytes();
      if (opt_s_.compile_remat) {
        ev["remat_buffers"] = v.remat_buffers;
        ev["remat_bytes"] = v.remat_bytes;
      }
      ev["compile_ms"] = v.capture_ms + v.plan_ms;
    }
    metrics_.write(ev);
    if (cb_.log)
      *cb_.log << "compiled steps: " << c.compiled << " compiled, " << c.eager << " eager, " << c.fallback
               << " fallback, " << c.guard_failures << " guard failures\n";
  }

  if (const std::string tuned = gemm_tune_summary(); !tuned.empty() && cb_.log) *cb_.log << tuned << "\n";

  sum.end_step = step_;
  if (std::isfinite(best_val_)) sum.best_val_loss = best_val_;
  sum.seconds = seconds_since(t_run);
  sum.tokens_per_s = sum.seconds > 0 ? double(sum.tokens) / sum.seconds : 0;
  sum.checkpoint = last_checkpoint_;
  metrics_.write({{"event", "summary"},
                  {"step", step_},
                  {"interrupted", sum.interrupted},
                  {"train_loss", sum.final_train_loss},
                  {"val_loss", sum.final_val_loss},
                  {"best_val_loss", sum.best_val_loss},
                  {"unigram_loss", sum.baseline_unigram},
                  {"bigram_loss", sum.baseline_bigram},
                  {"tokens", sum.tokens},
                  {"seconds", sum.seconds},
                  {"tok_per_s", sum.tokens_per_s},
                  {"peak_mem_bytes", sum.peak_mem_bytes},
                  {"checkpoint", sum.checkpoint}});
  if (cb_.log) {
    std::ostream& os = *cb_.log;
    char buf[160];
    os << "\nsummary" << (sum.interrupted ? " (interrupted)" : "") << ":\n";
    os << "  steps        " << sum.start_step << " -> " << sum.end_step << " of " << o.steps << "\n";
    std::snprintf(buf, sizeof buf, "  train loss   %.4f\n", sum.final_train_loss);
    os << buf;
    if (sum.final_val_loss >= 0) {
      std::snprintf(buf, sizeof buf, "  val loss     %.4f\n", sum.final_val_loss);
      os << buf;
    }
    if (baseline_) {
      std::snprintf(buf, sizeof buf, "  baseline     bigram %.4f, unigram %.4f (val loss %+.4f vs bigram)\n",
                    baseline_->bigram, baseline_->unigram, sum.final_val_loss - baseline_->bigram);
      os << buf;
    }
    if (o.keep_best && sum.best_val_loss >= 0) {
      std::snprintf(buf, sizeof buf, "  best val     %.4f in %s\n", sum.best_val_loss,
                    (fs::path(o.out) / kBestCheckpoint).string().c_str());
      os << buf;
    }
    std::snprintf(buf, sizeof buf, "  tokens       %s in %.1f s (%.0f tok/s)\n", format_count(sum.tokens).c_str(),
                  sum.seconds, sum.tokens_per_s);
    os << buf;
    os << "  peak memory  " << format_bytes(sum.peak_mem_bytes) << " (" << device_.str() << " allocator)\n";
    os << "  checkpoint   " << (sum.checkpoint.empty() ? "(none: no --out)" : sum.checkpoint) << "\n" << std::flush;
  }
  return sum;
}

}  // namespace blu::train
