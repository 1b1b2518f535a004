// Fuzz target: a checkpoint file's metadata — io/checkpoint's verification (format version,
// checksum), the model configuration and tokenizer a run recorded (train/model_spec), the newest
// valid checkpoint of a folder, and the same bytes as a global-tensor pieces file with its
// "pieces" index (io/global_tensors).
#include "blu/io/checkpoint.h"
#include "blu/io/global_tensors.h"
#include "blu/train/model_spec.h"
#include "fuzz_util.h"

namespace {

void try_each(const std::function<void()>& f) {
  try {
    f();
  } catch (const blu::Error&) {
  }
}

}  // namespace

BLU_FUZZ_TARGET({
  const std::string_view bytes = blu::fuzz::as_text(data, size);
  const auto dir = blu::fuzz::scratch("ckpt");
  const auto file = dir / "ckpt_00000001.safetensors";
  blu::fuzz::write_bytes(file, bytes);
  try_each([&] { blu::verify_checkpoint(file.string()); });
  try_each([&] { (void)blu::latest_valid_checkpoint(dir.string()); });
  try_each([&] { (void)blu::train::checkpoint_model_config(file.string()); });
  try_each([&] { (void)blu::train::checkpoint_tokenizer(file.string()); });
  const auto pieces = blu::fuzz::scratch("pieces");
  blu::fuzz::write_bytes(pieces / "pieces_00000.safetensors", bytes);
  const blu::GlobalTensorReader reader(pieces.string());
  for (const std::string& name : reader.names()) {
    // A piece names its whole tensor's shape; assembling allocates that first, so only small ones.
    int64_t numel = 1;
    for (int64_t d : reader.global_shape(name)) numel = d > 0 && numel <= (int64_t(1) << 20) / d ? numel * d : -1;
    if (numel < 0 || numel > (int64_t(1) << 20)) continue;
    try_each([&] { (void)reader.full(name); });
  }
})
