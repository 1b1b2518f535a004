// TrainOptions as JSON (run.json, the ranks' consistency fingerprint) and the checks of its values
// that the trainer makes before it builds or touches anything (declared in train/trainer.h).
#include <ostream>

#include "blu/compiler/exclude.h"
#include "blu/core/error.h"
#include "blu/train/trainer.h"

namespace blu::train {

nlohmann::json TrainOptions::to_json() const {
  nlohmann::json j = {{"train_pattern", train_pattern}, {"val_pattern", val_pattern},   {"model", model},
          {"batch_size", batch_size},       {"seq_len", seq_len},           {"grad_accum", grad_accum},
          {"steps", steps},                 {"lr", lr},                     {"min_lr", min_lr},
          {"warmup", warmup},               {"schedule", schedule},         {"weight_decay", weight_decay},
          {"grad_clip", grad_clip},         {"optimizer", optimizer},       {"beta1", beta1}, {"beta2", beta2},
          {"adamw_state", adamw_state},     {"seed", seed},
          {"device", device},               {"precision", precision},       {"out", out},                   {"val_every", val_every},
          {"val_batches", val_batches},     {"sample_every", sample_every}, {"sample_tokens", sample_tokens},
          {"sample_temperature", sample_temperature}, {"sample_top_k", sample_top_k},
          {"ckpt_every", ckpt_every},       {"keep_last", keep_last},       {"log_every", log_every},
          {"dp", dp},                       {"zero", zero}, {"row_exchange", row_exchange},
          {"auto_resume", auto_resume}, {"init_from", init_from}, {"dist_timeout", dist_timeout},
          {"dist_work_timeout", dist_work_timeout}, {"parallel", parallel}, {"keep_best", keep_best},
          {"baseline", baseline}, {"baseline_vocab", baseline_vocab}, {"baseline_max_tokens", baseline_max_tokens},
          {"tokenizer", tokenizer}, {"shuffle", shuffle}};
  j["compile"] = compile;  // the ranks agree on it (consistency fingerprint)
  if (compile_remat) j["compile_remat"] = true;
  if (loss_chunks > 0) j["loss_chunks"] = loss_chunks;
  if (master_weights != "fp32") j["master_weights"] = master_weights;
  // Taken again by a resume (Note [A resume takes the run's options]): with the table file, the
  // resumed run multiplies with the same algorithms (Note [GEMM tuning]).
  if (!gemm_tune.empty()) j["gemm_tune"] = gemm_tune;
  return j;
}

void check_options(const TrainOptions& o, const models::CausalLM& model) {
  BLU_CHECK(o.batch_size > 0, "--batch-size must be positive, got ", o.batch_size);
  BLU_CHECK(o.seq_len > 0, "--seq-len must be positive, got ", o.seq_len);
  BLU_CHECK(o.seq_len <= model.max_seq_len(), "--seq-len must be at most the model's longest sequence ",
            model.max_seq_len(), ", got ", o.seq_len);
  BLU_CHECK(o.grad_accum >= 1, "--grad-accum must be at least 1, got ", o.grad_accum);
  BLU_CHECK(o.steps >= 1, "--steps must be at least 1, got ", o.steps);
  BLU_CHECK(o.lr > 0 && o.min_lr >= 0, "learning rates must be positive: got --lr ", o.lr, ", --min-lr ", o.min_lr);
  BLU_CHECK(o.warmup >= 0, "--warmup must be >= 0, got ", o.warmup);
  BLU_CHECK(o.optimizer == "adamw" || o.optimizer == "sgd", "--optimizer must be adamw or sgd, got '", o.optimizer,
            "'");
  BLU_CHECK(o.val_batches >= 1, "--val-batches must be at least 1, got ", o.val_batches);
  BLU_CHECK(o.log_every >= 1, "--log-every must be at least 1, got ", o.log_every);
  BLU_CHECK(o.keep_last >= 1, "--keep-last must be at least 1, got ", o.keep_last);
  BLU_CHECK(o.val_every >= 0 && o.sample_every >= 0 && o.ckpt_every >= 0,
            "--val-every, --sample-every and --ckpt-every must be >= 0 (0 = off)");
  BLU_CHECK(!(o.resume && o.overwrite), "--resume and --overwrite contradict each other: give one");
  BLU_CHECK(!(o.auto_resume && (o.overwrite || o.resume)), "--auto-resume replaces --resume and contradicts ",
            "--overwrite: give one of the three");
  BLU_CHECK(o.dp >= 1, "--dp must be at least 1, got ", o.dp);
  if (o.compile) {  // before the run's files: a typo in an op's name is refused here, not mid-setup
    if (!o.compile_exclude.empty()) compiler::checked_op_list(o.compile_exclude, "--compile-exclude");
    else compiler::excluded_ops();  // reads (and checks) BLU_COMPILE_EXCLUDE
  }
  BLU_CHECK(o.loss_chunks >= 0, "--loss-chunks must be >= 0 (0: the logits made whole), got ", o.loss_chunks);
  BLU_CHECK(o.master_weights == "fp32" || o.master_weights == "split", "--master-weights must be fp32 or split, got '",
            o.master_weights, "'");
  BLU_CHECK(o.master_weights == "fp32" || (o.precision == "bf16" && o.optimizer == "adamw" && o.zero == 0 &&
                                            (o.offload_state == "auto" || o.offload_state == "none")),
            "--master-weights split keeps each fp32 master as its bf16 compute copy and 16 low bits, updated by ",
            "AdamW's own kernel: it needs --precision bf16, --optimizer adamw, --zero 0 and no --offload-state; got ",
            "--precision ", o.precision, ", --optimizer ", o.optimizer, ", --zero ", o.zero, ", --offload-state ",
            o.offload_state);
  BLU_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, "--beta1 and --beta2 must be in [0, 1), got ",
            o.beta1, " and ", o.beta2);
  BLU_CHECK(o.adamw_state == "f32" || o.adamw_state == "bf16", "--adamw-state must be f32 or bf16, got '",
            o.adamw_state, "'");
  BLU_CHECK(o.adamw_state == "f32" || (o.optimizer == "adamw" && (o.offload_state == "auto" || o.offload_state == "none")),
            "--adamw-state bf16 holds AdamW's moments on the device: it needs --optimizer adamw and no --offload-state; ",
            "got --optimizer ", o.optimizer, ", --offload-state ", o.offload_state);
  BLU_CHECK(o.zero >= 0 && o.zero <= 3, "--zero must be 0, 1, 2 or 3, got ", o.zero);
  BLU_CHECK(o.zero == 0 || o.dp > 1, "--zero ", o.zero, " shards over data-parallel ranks: it needs --dp > 1");
  BLU_CHECK(o.zero == 0 || o.optimizer == "adamw", "--zero ", o.zero, " is implemented for adamw, got --optimizer ",
            o.optimizer);
  BLU_CHECK(o.dist_timeout >= 0 && o.dist_timeout <= 1e9, "--dist-timeout must be >= 0 seconds (0: the default), got ",
            o.dist_timeout);
  BLU_CHECK(o.dist_work_timeout > 0 && o.dist_work_timeout <= 1e9, "--dist-work-timeout must be > 0 seconds, got ",
            o.dist_work_timeout);
  BLU_CHECK(!o.keep_best || o.zero == 0, "--keep-best keeps a single-file checkpoint: it needs --zero 0, got --zero ",
            o.zero);
  BLU_CHECK(!o.keep_best || !o.val_pattern.empty(), "--keep-best picks by validation loss: it needs validation ",
            "shards (--data-dir with *_val_*.bin, or --val-pattern)");
  BLU_CHECK(o.baseline_vocab >= 0 && o.baseline_vocab <= 65536, "baseline_vocab must be in [0, 65536], got ",
            o.baseline_vocab);
}

void warn_about_schedule(const TrainOptions& o, std::ostream& os) {
  // Schedules that do not do what their flags suggest are warned about, not refused: the defaults
  // of --min-lr and --warmup meet a small --lr or a short run.
  if (o.min_lr > o.lr && o.schedule != "constant")
    os << "warning: --min-lr " << o.min_lr << " is above --lr " << o.lr << ": the " << o.schedule
       << " schedule rises towards it; pass a --min-lr below --lr (e.g. " << o.lr / 10 << ")\n";
  if (o.warmup > o.steps)
    os << "warning: --warmup " << o.warmup << " is longer than the run (--steps " << o.steps
       << "): the learning rate never reaches --lr " << o.lr << "; pass --warmup " << o.steps / 10
       << " or less\n";
}

}  // namespace blu::train
