// `blutrain eval`: the validation loss of a checkpoint over N batches.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "blu/core/error.h"
#include "blu/data/loader.h"
#include "blu/train/model_spec.h"
#include "blu/train/trainer.h"
#include "commands.h"

namespace blu::cli {

namespace {

struct EvalArgs {
  std::string checkpoint, data_dir, val_pattern, device = "cpu";
  int64_t batch_size = 8, seq_len = 0, batches = 20;
};

int run_eval(const EvalArgs& a) {
  std::string pattern = a.val_pattern;
  if (pattern.empty()) {
    BLU_CHECK(!a.data_dir.empty(), "no validation data: expected --data-dir DIR or --val-pattern GLOB");
    pattern = (std::filesystem::path(a.data_dir) / "*_val_*.bin").string();
  }
  const Device device(a.device);
  auto model = train::load_model(a.checkpoint, device);
  const int64_t T = a.seq_len > 0 ? a.seq_len : model->max_seq_len();
  BLU_CHECK(T <= model->max_seq_len(), "--seq-len must be at most the model's block size ",
            model->max_seq_len(), ", got ", T);
  LoaderOptions lo;
  lo.prefetch = 0;
  lo.vocab_size = model->vocab_size();
  DataLoader loader(pattern, a.batch_size, T, 0, 1, lo);
  const int64_t n = std::min(a.batches, loader.batches_per_epoch());
  const double loss = train::evaluate(*model, loader, a.batches, device);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4f", loss);
  std::cout << "model " << a.checkpoint << "\n"
            << "val loss " << buf << " over " << n << " batch(es) of " << a.batch_size << "x" << T << " tokens\n";
  return 0;
}

}  // namespace

Command add_eval(CLI::App& root) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* app = root.add_subcommand("eval", "Validation loss of a checkpoint");
  app->add_option("--ckpt", a->checkpoint, "Checkpoint file, a run directory (its latest checkpoint), or a Hugging Face model folder")->required();
  app->add_option("--data-dir", a->data_dir, "Folder of shards (<dir>/*_val_*.bin)");
  app->add_option("--val-pattern", a->val_pattern, "Glob of validation shards (overrides --data-dir)");
  app->add_option("-B,--batch-size", a->batch_size, "Sequences per batch")->capture_default_str();
  app->add_option("-T,--seq-len", a->seq_len, "Tokens per sequence (default: the model's block size)");
  app->add_option("--batches", a->batches, "Batches to average over (at most one pass over the data)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--device", a->device, "cpu or cuda[:N]")->capture_default_str();
  return {app, [a] { return run_eval(*a); }};
}

}  // namespace blu::cli
