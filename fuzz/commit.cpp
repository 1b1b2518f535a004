// Fuzz target: a sharded or pipeline checkpoint's COMMIT file (dist/zero, dist/pipeline, and the
// listed-files check of io/checkpoint) holding the input, in a folder with one small file that a
// COMMIT may name.
#include "blu/dist/pipeline.h"
#include "blu/dist/zero.h"
#include "blu/dist/zero_checkpoint.h"
#include "blu/io/checkpoint.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  const auto dir = blu::fuzz::scratch("ckpt_00000001");
  static const bool once = [&] {
    blu::fuzz::write_bytes(dir / "a.safetensors", "0123456789");
    return true;
  }();
  (void)once;
  blu::fuzz::write_bytes(dir / "COMMIT", blu::fuzz::as_text(data, size));
  try {
    blu::dist::verify_sharded_checkpoint(dir.string());
  } catch (const blu::Error&) {
  }
  try {
    blu::dist::PipelineStage::verify_checkpoint(dir.string());
  } catch (const blu::Error&) {
  }
  (void)blu::dist::latest_sharded_checkpoint(dir.parent_path().string());
})
