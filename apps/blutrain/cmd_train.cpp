// `blutrain train`: flags (and an optional TOML/INI config file) → train::TrainOptions → Trainer.
// The config file is read with CLI11's TOML/INI reader but applied here, after parsing: CLI11
// 2.1's own --config is processed for the top-level app only, and train's options live in a
// subcommand. Same rules as CLI11's: keys are long flag names (top level or under [train]),
// the command line wins over the file, and an unknown key is an error naming it.
// The shards' folder (--data-dir, or the folder of --train-pattern) names their tokenizer
// (<dir>/shards.json, data/text_tokenizer.h; none: GPT-2's): samples decode with it, the n-gram
// baselines are smoothed over its vocabulary, and the model must have room for its ids.
// Note [Stop signals]: SIGTERM (what Slurm and Kubernetes send before they kill) and SIGINT
// (Ctrl-C; `blutrain launch` turns its own into SIGTERM to every rank) ask the trainer to finish
// the current step, save a checkpoint (the ranks agree on the step through the stop flags that
// Strategy::read combines) and return; the command then exits with kExitStoppedResumable (75) and
// says how to continue. A second signal kills the process at once. The first signal also dumps
// the flight recorder (dist/flight_recorder.h) from its own thread, so a rank that never reaches
// the end of its step still leaves a record of its last collectives.
#include <atomic>
#include <csignal>
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <signal.h>
#include <unistd.h>

#include "blu/core/error.h"
#include "blu/data/loader.h"
#include "blu/data/text_tokenizer.h"
#include "blu/data/tokenizer.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/env.h"
#include "blu/dist/launch.h"
#include "blu/models/registry.h"
#include "blu/train/model_spec.h"
#include "blu/train/run_record.h"
#include "blu/train/trainer.h"
#include "commands.h"
#include "suggest.h"

namespace blu::cli {

namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) {
  if (g_stop.exchange(true)) {  // the second signal: the default action, now
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
  dist::FlightRecorder::global().request_dump_from_signal(sig);  // a rank stuck in a collective says where
  static const char msg[] =
      "\n[stop] finishing the current step, then saving a checkpoint (a second Ctrl-C or SIGTERM kills)\n";
  (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
}

void install_stop_handlers() {
  // The handler asks the flight recorder for a dump; its singleton is made here, outside the
  // handler: made inside it, it would allocate, and a signal that lands in malloc deadlocks on the
  // allocator's lock (seen: SIGTERM during a free in zero_grad).
  (void)dist::FlightRecorder::global();
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

struct TrainArgs {
  train::TrainOptions o;
  std::string config, data_dir, model = "demo", prompt;
  train::ModelOverrides overrides;
  bool model_given = false;    // --model on the command line or in the config file
  nlohmann::json run_model;    // a resumed run's model (its run.json), used when --model is not given
};

bool any_match(const std::string& pattern) {
  try {
    return !expand_shard_pattern(pattern).empty();
  } catch (const Error&) {
    return false;
  }
}

void apply_config_file(CLI::App& app, const std::string& path) {
  BLU_CHECK(std::filesystem::is_regular_file(path), "--config: expected a TOML/INI file, got '", path,
            "' (not found)");
  CLI::ConfigTOML reader;
  for (const CLI::ConfigItem& item : reader.from_file(path)) {
    if (item.name == "++" || item.name == "--") continue;  // section open / close markers
    BLU_CHECK(item.parents.empty() || (item.parents.size() == 1 && item.parents[0] == "train"),
              "unknown section '", item.fullname(), "' in the config file ", path,
              ": expected keys at the top level or under [train]");
    // A key is a long option's name, or its run.json spelling (batch_size for batch-size).
    std::string dashed = item.name;
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    CLI::Option* op = app.get_option_no_throw("--" + dashed);
    if (op == nullptr || dashed == "config") {
      const std::string near = closest(dashed, long_options(app));
      BLU_CHECK(false, "unknown key '", item.name, "' in the config file ", path,
                near.empty() ? std::string(" (expected a long option of `blutrain train`, e.g. lr, batch-size, steps)")
                             : " — did you mean '" + near + "'?");
    }
    if (op->count() > 0) continue;  // given on the command line (or earlier in the file): that wins
    if (op->get_expected_min() == 0)
      op->add_result(op->get_flag_value(item.name, reader.to_flag(item)));
    else
      op->add_result(item.inputs);
    op->run_callback();  // validators, then the bound variable
  }
}

// Note [A resume takes the run's options]: `train --out RUN --resume` (or --auto-resume) needs no
// other flag. Every option of RUN/run.json's latest invocation that is not given on the command
// line or in the config file is taken from it — the model (its recorded config), the data (unless
// --data-dir or --train-pattern is given), the batch, the optimizer, the schedule, the events, and
// the layout (--dp, --zero, --parallel) as a whole when none of it is given and the job has as many
// processes as the run had. What is given wins; the trainer then refuses a given value that changes the trajectory
// (train/run_record.h) unless --allow-changes. Options run.json does not record (recompute,
// offload, the compiler's switches) are given again when wanted: they change memory, not numbers.
// --gemm-tune is recorded when given, and taken: it changes the products' last bits.
void take_from_run_record(CLI::App& app, TrainArgs& a) {
  train::TrainOptions& o = a.o;
  const nlohmann::json rec = train::recorded_options(o.out);
  if (rec.is_null()) return;
  a.run_model = train::recorded_model(o.out);
  const auto given = [&](const std::string& flag) {
    const CLI::Option* op = app.get_option_no_throw(flag);
    return op != nullptr && op->count() > 0;
  };
  const bool data_given = given("--data-dir") || given("--train-pattern");
  // The layout as a whole, and only onto as many processes as the run had: a resume under another
  // launcher (another number of ranks, another layout) gives its own.
  const bool layout_given = given("--dp") || given("--zero") || given("--parallel") || given("--no-row-exchange");
  const bool same_world = train::recorded_world_size(o.out) == dist::detect_env().world_size;
  const auto is_layout = [](const std::string& k) {
    return k == "dp" || k == "zero" || k == "parallel" || k == "row_exchange";
  };
  // Flags: a bool each (the two negative ones hold the option's inverse).
  const struct {
    const char* key;
    const char* flag;
    bool* value;
  } flags[] = {{"shuffle", "--shuffle", &o.shuffle},         {"keep_best", "--keep-best", &o.keep_best},
               {"compile", "--compile", &o.compile},         {"baseline", "--no-baseline", &o.baseline},
               {"row_exchange", "--no-row-exchange", &o.row_exchange}};
  int taken = 0;
  for (const auto& [key, value] : rec.items()) {
    if (key == "model" || key == "out" || key == "tokenizer" || key == "init_from" || key == "resume" ||
        key == "auto_resume")
      continue;  // the model is run_model; the tokenizer follows the data; the rest name this invocation
    if ((key == "train_pattern" || key == "val_pattern") && data_given) continue;
    if (is_layout(key) && (layout_given || !same_world)) continue;
    bool is_flag = false;
    for (const auto& f : flags) {
      if (key != f.key) continue;
      is_flag = true;
      if (!given(f.flag) && value.is_boolean()) {
        *f.value = value.get<bool>();
        ++taken;
      }
    }
    if (is_flag) continue;
    std::string dashed = key;
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    CLI::Option* op = app.get_option_no_throw("--" + dashed);
    if (op == nullptr || op->count() > 0) continue;  // not a flag of train (a default), or given
    if (!value.is_string() && !value.is_number()) continue;
    op->add_result(value.is_string() ? value.get<std::string>() : value.dump());
    op->run_callback();
    ++taken;
  }
  if (taken > 0)
    std::cout << "note: the options not given here are those of " << (std::filesystem::path(o.out) / "run.json").string()
              << "\n";
}

int run_train(TrainArgs a) {
  train::TrainOptions& o = a.o;
  if (!a.data_dir.empty()) {
    const std::filesystem::path d = a.data_dir;
    BLU_CHECK(std::filesystem::is_directory(d), "--data-dir: expected a folder of token shards, got '", a.data_dir,
              "' (not a folder)");
    if (o.train_pattern.empty()) o.train_pattern = (d / "*_train_*.bin").string();
    if (o.val_pattern.empty()) {
      const std::string v = (d / "*_val_*.bin").string();
      if (any_match(v))
        o.val_pattern = v;
      else
        std::cout << "note: no validation shards match " << v << "; training without validation\n";
    }
  }
  BLU_CHECK(!o.train_pattern.empty(), "no training data: expected --data-dir DIR or --train-pattern GLOB");
  // The model: --model's, else a resumed run's, else --init-from's; --n-layer etc. on top.
  nlohmann::json base;
  if (!a.model_given && !a.run_model.is_null())
    base = a.run_model;
  else if (!a.model_given && !o.init_from.empty())
    base = train::init_source_config(o.init_from);
  else
    base = models::resolve_model_config(a.model);
  o.model = train::apply_overrides(base, a.overrides);
  if (o.init_from.empty() && a.model_given && models::is_hf_spec(a.model))
    o.init_from = models::hf_folder(a.model);  // train from its weights

  train::TrainCallbacks cb;
  cb.log = &std::cout;
  cb.stop = &g_stop;
  // A Hugging Face model folder's own tokenizer.json, else the one the shards record (GPT-2's
  // where they record none).
  namespace fs = std::filesystem;
  const std::string shard_dir = !a.data_dir.empty() ? a.data_dir : shard_dir_of_pattern(o.train_pattern);
  const bool recorded = fs::is_regular_file(fs::path(shard_dir) / kShardsRecord);
  const bool hf_tok = !o.init_from.empty() && fs::is_regular_file(fs::path(o.init_from) / "tokenizer.json");
  std::string tok_spec = hf_tok ? o.init_from : shards_tokenizer(shard_dir);
  if (tok_spec != "byte" && tok_spec != "gpt2") tok_spec = fs::absolute(tok_spec).lexically_normal().string();
  o.tokenizer = tok_spec;
  std::shared_ptr<TextTokenizer> tok;
  if (recorded || hf_tok || o.sample_every > 0) tok = load_tokenizer(tok_spec);
  if (tok) {
    const int64_t model_vocab = o.model.value("vocab_size", int64_t(0));
    BLU_CHECK(model_vocab <= 0 || tok->vocab_size() <= model_vocab, "--model ", a.model, " has ", model_vocab,
              " token ids, but the shards in ", shard_dir, " were written with tokenizer ", tok_spec, " (",
              tok->vocab_size(), " ids): choose a model with at least ", tok->vocab_size(),
              " (for byte shards: --model gpt2:demo-byte)");
    if (model_vocab > 4 * int64_t(tok->vocab_size()))
      std::cout << "note: --model " << a.model << " has " << model_vocab << " token ids for the "
                << tok->vocab_size() << " of tokenizer " << tok_spec
                << "; a model sized to it trains faster (for byte shards: --model gpt2:demo-byte)\n";
    if (o.baseline_vocab == 0) o.baseline_vocab = tok->vocab_size();
  }
  if (o.sample_every > 0) {
    cb.decode = [tok](const std::vector<int32_t>& ids) { return tok->decode(ids); };
    const std::optional<int32_t> start = tok->bos_id() ? tok->bos_id() : tok->eos_id();
    cb.sample_prompt = tok->encode(a.prompt);
    if (start && (a.prompt.empty() || (tok->bos_id() && tok->bos_id() != tok->eos_id())))
      cb.sample_prompt.insert(cb.sample_prompt.begin(), *start);
  }
  // From here a signal stops the run at a step boundary (a stop asked for while the trainer starts
  // takes effect after its first step).
  g_stop = false;
  install_stop_handlers();
  train::Trainer trainer(o, cb);
  const train::TrainSummary sum = trainer.run();  // prints the summary
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (!sum.interrupted) return 0;
  if (trainer.strategy().rank() == 0) {
    const int sig = g_stop_signal.load();
    std::cout << "\nstopped at step " << sum.end_step << " of " << o.steps
              << (sig ? std::string(" by ") + (sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a signal")
                      : std::string(" (a stop requested on another rank)"))
              << "; checkpoint " << (sum.checkpoint.empty() ? std::string("(none: no --out)") : sum.checkpoint)
              << "\nto continue, run the same command with --auto-resume (or --resume)\n"
              << std::flush;
  }
  return dist::kExitStoppedResumable;
}

}  // namespace

Command add_train(CLI::App& root) {
  auto a = std::make_shared<TrainArgs>();
  train::TrainOptions& o = a->o;
  CLI::App* app = root.add_subcommand("train", "Train a causal language model on token shards");
  // A flag given twice takes its last value, so scripts/demo.sh's defaults can be overridden by the
  // arguments passed on to it (`scripts/demo.sh --steps 50`).
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app->add_option("--config", a->config,
                  "TOML/INI file of train options: keys are the long flag names (lr = 3e-4, batch-size = 16); "
                  "flags given on the command line win; an unknown key is an error");

  // Data.
  app->add_option("--data-dir", a->data_dir, "Folder of shards: <dir>/*_train_*.bin and <dir>/*_val_*.bin");
  app->add_option("--train-pattern", o.train_pattern, "Glob of training shards (overrides --data-dir)");
  app->add_option("--val-pattern", o.val_pattern, "Glob of validation shards (overrides --data-dir)");
  app->add_flag("--shuffle", o.shuffle,
                "Read the training windows in a permuted order (per epoch, from --seed) instead of in file order");
  // Model.
  std::string presets;
  for (const auto& f : models::family_names())
    for (const auto& n : models::family(f).presets) presets += (presets.empty() ? "" : ", ") + f + ":" + n;
  app->add_option("--model", a->model,
                  "FAMILY:PRESET (" + presets + "), a bare GPT-2 preset (d12, tiny, ...), or a Hugging Face model "
                  "folder (config.json + safetensors: training starts from its weights)")
      ->capture_default_str();
  app->add_option("--n-layer", a->overrides.n_layer, "Override the preset's number of layers");
  app->add_option("--n-head", a->overrides.n_head, "Override the preset's number of heads");
  app->add_option("--n-embd", a->overrides.n_embd, "Override the preset's width");
  app->add_option("--block-size", a->overrides.block_size, "Override the preset's context length");
  // Batch and steps.
  app->add_option("-B,--batch-size", o.batch_size, "Sequences per micro-batch")->capture_default_str();
  app->add_option("-T,--seq-len", o.seq_len, "Tokens per sequence (default: the model's block size)");
  app->add_option("--grad-accum", o.grad_accum, "Micro-batches per optimizer step")->capture_default_str();
  app->add_option("--steps", o.steps, "Optimizer steps (the schedule's length)")->capture_default_str();
  // Optimizer.
  app->add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  app->add_option("--min-lr", o.min_lr, "Learning rate at the end of the schedule")->capture_default_str();
  app->add_option("--warmup", o.warmup, "Linear warmup steps")->capture_default_str();
  app->add_option("--schedule", o.schedule, "cosine, linear or constant")
      ->check(CLI::IsMember({"cosine", "linear", "constant"}))
      ->capture_default_str();
  app->add_option("--weight-decay", o.weight_decay, "Decoupled weight decay of matrices and embeddings")
      ->capture_default_str();
  app->add_option("--grad-clip", o.grad_clip, "Clip the global gradient norm to this (0 = off)")->capture_default_str();
  app->add_option("--optimizer", o.optimizer, "adamw (--beta1, --beta2) or sgd (momentum 0.9)")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->capture_default_str();
  app->add_option("--beta1", o.beta1, "AdamW's first-moment decay")->capture_default_str();
  app->add_option("--beta2", o.beta2, "AdamW's second-moment decay")->capture_default_str();
  app->add_option("--seed", o.seed, "Seed of the model init, the default generator and samples")->capture_default_str();
  app->add_option("--device", o.device, "cpu or cuda[:N]")->capture_default_str();
  app->add_option("--precision", o.precision, "fp32 (IEEE matmuls), tf32, bf16 or fp16 (16-bit compute over fp32 master weights; fp16 with dynamic loss scaling)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}))
      ->capture_default_str();
  // Activations (models/activations.h).
  app->add_option("--recompute", o.recompute,
                  "Activation recompute: none, selective (attention core, MLP activation), mlp (the MLP's input "
                  "projection and activation), mlp:N (that on every N-th block), block (every block), block:N (every "
                  "N-th), or parts joined by + in that order (selective+block:N, mlp:N+block:M, selective+mlp), or auto: the least of none, mlp:4, mlp:2, selective, "
                  "block:4, selective+block:4, mlp, block:2, selective+block:2, selective+mlp, block whose plan fits --gpu-memory-budget, each also with --loss-chunks 4, then 8, unless --loss-chunks is given")
      ->capture_default_str();
  app->add_option("--loss-chunks", o.loss_chunks,
                  "Compute the LM head and its loss in this many row pieces, each piece's gradient at once, so the "
                  "[B*T, vocab] logits are never held whole (ops/fused.h, Note [Chunked loss]); 0: off (under --recompute auto: "
                  "the planner's choice); 1: whole logits always")
      ->capture_default_str();
  app->add_flag("--offload-activations", o.offload_activations,
                "Copy the blocks' saved activations to host memory as they are saved, fetched back ahead of backward");
  app->add_option("--peak-tflops", o.peak_tflops,
                  "The device's dense matmul peak (TFLOP/s) for the MFU logged each step; 0: the GPU's datasheet peak "
                  "(H100, H200, A100, L40S), none on the CPU")
      ->check(CLI::NonNegativeNumber);
  // Run directory.
  app->add_option("--out", o.out, "Run directory: metrics.jsonl, run.json, checkpoints");
  app->add_flag("--overwrite", o.overwrite, "Replace the run in --out (removes its metrics, run.json, checkpoints)");
  app->add_flag("--resume", o.resume,
                "Continue exactly from the latest checkpoint in --out, with the options of its run.json for every "
                "option not given");
  app->add_flag("--allow-changes", o.allow_changes,
                "With --resume or --auto-resume: continue the run with a given option that differs from its "
                "run.json and changes the trajectory (--lr, -B, --model, ...), refused without this");
  app->add_option("--init-from", o.init_from,
                  "Start from the weights of a Hugging Face folder, a checkpoint file or a run directory's newest "
                  "checkpoint (fine-tuning: a fresh optimizer at step 0); without --model, the model is the source's");
  app->add_flag("--auto-resume", o.auto_resume,
                "Continue from the latest checkpoint in --out if there is one, else start there (a run of the "
                "same model without a checkpoint starts over): for `blutrain launch --max-restarts`");
  // Events.
  app->add_option("--val-every", o.val_every, "Validation loss every N steps (0 = only at the end)")
      ->capture_default_str();
  app->add_option("--val-batches", o.val_batches, "Batches per validation")->capture_default_str();
  app->add_option("--sample-every", o.sample_every, "Print a text sample every N steps (0 = never)")
      ->capture_default_str();
  app->add_option("--sample-tokens", o.sample_tokens, "Tokens per sample")->capture_default_str();
  app->add_option("--prompt", a->prompt, "Prompt for samples (default: <|endoftext|>)");
  app->add_option("--ckpt-every", o.ckpt_every, "Checkpoint every N steps (0 = only at the end)")
      ->capture_default_str();
  app->add_option("--keep-last", o.keep_last, "Checkpoints kept in --out")->capture_default_str();
  app->add_flag("--keep-best", o.keep_best,
                "Also keep <out>/best.safetensors, the checkpoint of the lowest validation loss so far (a "
                "checkpoint is written at each validation that improves on it)");
  app->add_flag("!--no-baseline", o.baseline,
                "Do not count the unigram/bigram baselines of the validation data (shown beside the val loss)");
  app->add_option("--log-every", o.log_every, "Progress line every N steps")->capture_default_str();
  // Data parallel.
  app->add_option("--dp", o.dp,
                  "Data-parallel ranks; must equal the launcher's WORLD_SIZE (blutrain launch -n N -- blutrain "
                  "train --dp N ...); --batch-size is per rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--parallel", o.parallel,
                  "The parallel layout as annotations (docs/distributed.md), e.g. \"replicate(2, zero=1)\" or "
                  "\"pipeline(2, schedule=1f1b, micro=4)\"; its rank count must equal the launched world size");
  app->add_option("--zero", o.zero,
                  "ZeRO stage with --dp > 1: 0 (DDP), 1 (shard optimizer state), 2 (and gradients), 3 (and "
                  "parameters, gathered block by block)")
      ->capture_default_str()
      ->check(CLI::Range(0, 3));
  app->add_option("--dist-timeout", o.dist_timeout,
                  "Seconds after which the store, Gloo and NCCL give up on a peer and end the job with an error "
                  "(0: BLU_DIST_TIMEOUT, else 30 s for the store and Gloo, 600 s for NCCL)")
      ->check(CLI::Range(0.0, 1e9));
  app->add_option("--dist-work-timeout", o.dist_work_timeout,
                  "Seconds the other ranks wait for rank 0's checkpoint or sample, or for validation, before "
                  "giving up (a store barrier, not a collective)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 1e9));
  // Memory budget and optimizer state offload (docs/offload.md).
  app->add_option("--gpu-memory-budget", o.gpu_memory_budget,
                  "GiB the device may hold: the planner keeps AdamW's state on the device or offloads it to host "
                  "memory to fit, prints the plan, and fails before the first step when nothing fits (a device "
                  "pool --device cpu:N enforces it)")
      ->check(CLI::Range(0.0, 1e6));
  app->add_option("--host-memory-budget", o.host_memory_budget, "GiB of host memory the offloaded state may take")
      ->check(CLI::Range(0.0, 1e6));
  app->add_option("--offload-state", o.offload_state,
                  "auto (offload what the budget needs), none, optimizer (AdamW's state, always), or master (AdamW's "
                  "state and the fp32 master weights: the device keeps the 16-bit weights and the gradients; bf16/fp16, "
                  "--offload-update cpu), or master+grads (and those parameters' gradients, moved to the host as the "
                  "backward makes them; one rank, bf16)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "none", "optimizer", "master", "master+grads"}));
  app->add_option("--master-weights", o.master_weights,
                  "fp32, or split: in bf16 each fp32 master weight that a forward reads through its bf16 compute copy "
                  "is held as that copy and its low 16 bits (2 bytes a parameter less; the copy rounds ties away "
                  "from zero; AdamW without --zero or offload)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "split"}));
  app->add_option("--adamw-state", o.adamw_state,
                  "f32, or bf16: AdamW's two moments held in bf16 and stored rounded stochastically (4 bytes a "
                  "parameter less, half the update's state traffic; on the device, no --offload-state)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  app->add_option("--offload-update", o.offload_update,
                  "Where offloaded AdamW runs: cpu (threaded host AdamW), gpu (moments streamed through the "
                  "device in chunks), auto (the faster by a start-up probe)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "cpu", "gpu"}));
  app->add_option("--offload-chunk", o.offload_chunk, "Elements per streamed chunk of the offloaded update (gpu: staged moments; cpu: staged gradients)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_flag("--offload-overlap", o.offload_overlap,
                "With the update on the cpu: the blocks' update runs on a worker thread behind the next step's "
                "forward, each block waiting for its own (docs/offload.md; measured gain small and host-dependent)");
  app->add_flag("!--no-row-exchange", o.row_exchange,
                "With --dp > 1: reduce the tied embedding's whole gradient at the end of backward instead "
                "of its LM-head part early and its rows apart (docs/distributed.md)");
  // Compiler (docs/compiler.md).
  app->add_flag("--compile", o.compile,
                "Run every training step compiled: captured once without kernels, its memory planned into one "
                "arena, replayed (a CUDA graph on the GPU); bitwise the eager step. Layouts the compiler does not "
                "support yet are refused at start");
  app->add_flag("--compile-log", o.compile_log,
                "With --compile: print the graph size, memory plan, compile time and guard failures (as "
                "BLU_COMPILE_LOG=1)");
  app->add_flag("--compile-check", o.compile_check,
                "With --compile: run each fused region's first launch against its ops run eagerly on the same "
                "inputs and print the largest difference (as BLU_COMPILE_CHECK=1; replays without CUDA graphs)");
  app->add_option("--compile-exclude", o.compile_exclude,
                  "With --compile: comma-separated op names kept out of compilation (their buffers outside the "
                  "arena, never fused); default BLU_COMPILE_EXCLUDE");
  app->add_flag("--compile-remat", o.compile_remat,
                "With --compile: the compiler decides what to recompute — a saved activation whose cheap producer "
                "(pointwise, a norm, a cast) reads only what is held anyway is dropped after the forward and made "
                "again before its backward use; bitwise the same step (docs/compiler.md)");
  app->add_option("--gemm-tune", o.gemm_tune,
                  "on: time cuBLASLt's candidate algorithms for each GEMM shape on its first call and keep the "
                  "fastest, remembered in BLU_GEMM_TUNE_FILE (default ~/.cache/blutrain/gemm_tune.tsv) so a resumed "
                  "run multiplies the same way; off: the heuristic's first choice (default BLU_GEMM_TUNE, else off)")
      ->check(CLI::IsMember({"on", "off"}));
  app->add_option("--compile-fuse", o.compile_fuse,
                  "With --compile: on fuses pointwise and row regions into generated kernels (the MLIR fusion "
                  "pass, or a fusion plan from the kernel cache in a build without MLIR) and chooses GEMM "
                  "epilogues, off runs every op's eager kernel (docs/compiler_mlir.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app->add_option("--compile-export", o.compile_export,
                  "With --compile: a directory where the captured step is written when its fusion plan is not in "
                  "the kernel cache (the GPU machine, no MLIR); `blutrain compile --from-graph` fuses it where "
                  "MLIR is installed (docs/compiler_mlir.md)");
  return {app, [a, app] {
            if (!a->config.empty()) apply_config_file(*app, a->config);
            a->model_given = app->get_option("--model")->count() > 0;
            if ((a->o.resume || a->o.auto_resume) && !a->o.out.empty()) take_from_run_record(*app, *a);
            return run_train(*a);
          }};
}

}  // namespace blu::cli
