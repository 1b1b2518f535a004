// `blutrain export` and `blutrain import`: a trained model to a Hugging Face folder (config.json,
// model.safetensors and, when the run's tokenizer is a tokenizer.json, that file) and back into a
// checkpoint folder that eval, sample and `train --init-from` read. Each writes into a temporary
// folder beside its destination and renames it into place, so a failed export or import leaves
// nothing behind and an existing destination is replaced only with --overwrite, and only once the
// new folder is complete.
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "blu/core/error.h"
#include "blu/io/checkpoint.h"
#include "blu/models/registry.h"
#include "blu/train/model_spec.h"
#include "blu/train/trainer.h"
#include "commands.h"

namespace blu::cli {

namespace {

namespace fs = std::filesystem;

struct ExportArgs {
  std::string source, dest;
  bool overwrite = false;
};

// The destination folder may not exist, or may be replaced (--overwrite): a temporary sibling to
// write into, renamed over it by commit().
class StagedFolder {
 public:
  StagedFolder(const std::string& dest, bool overwrite, const char* what) : dest_(fs::absolute(dest)) {
    BLU_CHECK(!fs::exists(dest_) || fs::is_directory(dest_), what, ": the destination ", dest,
              " exists and is not a folder");
    BLU_CHECK(overwrite || !fs::exists(dest_) || fs::is_empty(dest_), what, ": the destination ", dest,
              " is a folder that is not empty: pass --overwrite to replace it, or choose another folder");
    fs::create_directories(dest_.parent_path());
    tmp_ = dest_.parent_path() / ("." + dest_.filename().string() + ".partial");
    fs::remove_all(tmp_);  // what an interrupted export left
    fs::create_directory(tmp_);
  }
  ~StagedFolder() {
    std::error_code ec;
    if (!committed_) fs::remove_all(tmp_, ec);
  }
  const fs::path& path() const { return tmp_; }
  void commit() {
    if (fs::exists(dest_)) fs::remove_all(dest_);
    fs::rename(tmp_, dest_);
    committed_ = true;
  }

 private:
  fs::path dest_, tmp_;
  bool committed_ = false;
};

int run_export(const ExportArgs& a) {
  BLU_CHECK(!fs::is_regular_file(fs::path(a.source) / "config.json"), "export: ", a.source,
            " is a Hugging Face folder already (expected a checkpoint file or a run directory)");
  const std::string ckpt = fs::is_directory(a.source) ? train::resolve_checkpoint(a.source) : a.source;
  auto model = train::load_model(ckpt, kCPU);
  const auto& fam = models::family(models::family_of(model->config()));
  BLU_CHECK(fam.export_hf, "export: the ", fam.name, " family has no Hugging Face export");
  StagedFolder out(a.dest, a.overwrite, "export");
  fam.export_hf(*model, out.path().string());
  // The tokenizer goes along when the run's is a tokenizer.json (a file, or a folder holding one).
  const std::string tok = train::checkpoint_tokenizer(ckpt);
  fs::path tok_file = tok;
  if (!tok.empty() && fs::is_directory(tok_file)) tok_file /= "tokenizer.json";
  const bool copied = !tok.empty() && tok != "gpt2" && tok != "byte" && fs::is_regular_file(tok_file);
  if (copied) fs::copy_file(tok_file, out.path() / "tokenizer.json");
  out.commit();
  std::cout << "exported " << ckpt << " (" << fam.name << ", " << model->num_parameters() << " parameters) to "
            << a.dest << "\n";
  if (!copied)
    std::cout << "note: no tokenizer.json written: the run's tokenizer is "
              << (tok.empty() || tok == "gpt2" ? std::string("GPT-2's (Hugging Face's \"gpt2\" tokenizer)")
                                              : "'" + tok + "', which has no tokenizer.json")
              << "\n";
  return 0;
}

int run_import(const ExportArgs& a) {
  BLU_CHECK(fs::is_regular_file(fs::path(a.source) / "config.json"), "import: expected a Hugging Face model folder ",
            "(config.json and safetensors weights), got '", a.source, "'");
  auto model = train::load_model(a.source, kCPU);
  TrainState st;
  st.model_config = model->config();
  const fs::path tok = fs::absolute(fs::path(a.source) / "tokenizer.json");
  if (fs::is_regular_file(tok)) st.run = {{"tokenizer", tok.lexically_normal().string()}};
  StagedFolder out(a.dest, a.overwrite, "import");
  const std::string file = save_checkpoint(out.path().string(), *model, nullptr, st, /*keep_last=*/1);
  out.commit();
  std::cout << "imported " << a.source << " (" << models::family_of(st.model_config) << ", "
            << model->num_parameters() << " parameters) to " << (fs::path(a.dest) / fs::path(file).filename()).string()
            << "\nuse it with eval --ckpt, sample --ckpt or train --init-from " << a.dest << "\n";
  return 0;
}

}  // namespace

Command add_export(CLI::App& root) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* app = root.add_subcommand("export", "Write a checkpoint's model as a Hugging Face folder");
  app->add_option("source", a->source, "Checkpoint file, or a run directory (its newest checkpoint that verifies)")
      ->required();
  app->add_option("dest", a->dest, "The Hugging Face folder to write (config.json, model.safetensors)")->required();
  app->add_flag("--overwrite", a->overwrite, "Replace dest if it is a folder that is not empty");
  return {app, [a] { return run_export(*a); }};
}

Command add_import(CLI::App& root) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* app = root.add_subcommand("import", "Turn a Hugging Face model folder into a checkpoint folder");
  app->add_option("source", a->source, "Hugging Face model folder (config.json, safetensors, tokenizer.json)")
      ->required();
  app->add_option("dest", a->dest, "The folder to write its checkpoint into (ckpt_00000000.safetensors)")
      ->required();
  app->add_flag("--overwrite", a->overwrite, "Replace dest if it is a folder that is not empty");
  return {app, [a] { return run_import(*a); }};
}

}  // namespace blu::cli
