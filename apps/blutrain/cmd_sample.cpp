// `blutrain sample`: text from a checkpoint — prompt, then CausalLM::generate (key/value cache) with
// temperature and top-k, decoded with the run's tokenizer (the one its shards record: byte, GPT-2's,
// a tokenizer.json), a Hugging Face folder's tokenizer.json, or --tokenizer.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/core/rng.h"
#include <filesystem>
#include <optional>

#include "blu/data/text_tokenizer.h"
#include "blu/data/tokenizer.h"
#include "blu/train/model_spec.h"
#include "blu/train/trainer.h"
#include "commands.h"

namespace blu::cli {

namespace {

struct SampleArgs {
  std::string checkpoint, prompt, device = "cpu", vocab_dir;
  int64_t max_new_tokens = 100, top_k = 40, num_samples = 1;
  double temperature = 1.0;
  uint64_t seed = 1337;
};

int run_sample(const SampleArgs& a) {
  // --tokenizer; else the model folder's tokenizer.json when --ckpt is a Hugging Face folder; else
  // the tokenizer the run recorded; else GPT-2's.
  std::string tok_path = a.vocab_dir;
  if (tok_path.empty() && std::filesystem::is_regular_file(std::filesystem::path(a.checkpoint) / "tokenizer.json"))
    tok_path = a.checkpoint;
  if (tok_path.empty()) tok_path = train::checkpoint_tokenizer(a.checkpoint);
  const std::unique_ptr<TextTokenizer> tok = load_tokenizer(tok_path.empty() ? "gpt2" : tok_path);
  auto model = train::load_model(a.checkpoint, Device(a.device));
  BLU_CHECK(tok->vocab_size() <= model->vocab_size(), "the tokenizer has ", tok->vocab_size(), " ids, the model ",
            model->vocab_size(), ": pass the model's tokenizer with --tokenizer");
  // A prompt starts after the beginning-of-text token (GPT-2: <|endoftext|>) when the tokenizer has one.
  const std::optional<int32_t> start = tok->bos_id() ? tok->bos_id() : tok->eos_id();
  std::vector<int32_t> prompt = tok->encode(a.prompt);
  // (GPT-2's bos and eos are the same <|endoftext|>, which its prompts do not start with.)
  if (start && (a.prompt.empty() || (tok->bos_id() && tok->bos_id() != tok->eos_id()))) prompt.insert(prompt.begin(), *start);
  BLU_CHECK(!prompt.empty(), "sample: an empty prompt needs a tokenizer with a beginning- or end-of-text token");
  const int64_t n = a.max_new_tokens;  // past the block size, generate() slides the window
  Generator gen(a.seed);
  NoGradGuard no_grad;
  for (int64_t i = 0; i < a.num_samples; ++i) {
    const std::vector<int32_t> ids = model->generate(prompt, n, a.temperature, a.top_k, gen);  // new tokens only
    if (a.num_samples > 1) std::cout << "--- sample " << i + 1 << " ---\n";
    std::cout << a.prompt << tok->decode(ids) << "\n";
  }
  return 0;
}

}  // namespace

Command add_sample(CLI::App& root) {
  auto a = std::make_shared<SampleArgs>();
  CLI::App* app = root.add_subcommand("sample", "Generate text from a checkpoint");
  app->add_option("--ckpt", a->checkpoint, "Checkpoint file, a run directory (its latest checkpoint), or a Hugging Face model folder")->required();
  app->add_option("-p,--prompt", a->prompt, "Text to continue (default: start of a document)");
  app->add_option("-n,--max-new-tokens", a->max_new_tokens, "Tokens to generate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--temperature", a->temperature,
                  "Softmax temperature (lower: more conservative; 0: greedy, the most likely token every time)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--top-k", a->top_k, "Sample among the k most likely tokens (0 = all)")->capture_default_str();
  app->add_option("--seed", a->seed, "Sampling seed")->capture_default_str();
  app->add_option("--num-samples", a->num_samples, "How many samples")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--device", a->device, "cpu or cuda[:N]")->capture_default_str();
  app->add_option("--tokenizer,--vocab-dir", a->vocab_dir,
                  "byte, gpt2, a tokenizer.json or a folder holding one or GPT-2's encoder.json and vocab.bpe "
                  "(default: the --ckpt folder's tokenizer.json, else the run's recorded tokenizer, else gpt2)");
  return {app, [a] { return run_sample(*a); }};
}

}  // namespace blu::cli
