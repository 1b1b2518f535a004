// How single/ and zero/ here were written: this file, built as an executable against the library
// at commit 765617b (the format before checkpoint versions and checksums), run as
//   gen shards DATA x                          the toy shards (tests/train/train_test_util.h)
//   gen single DATA OUT                        4 steps, a checkpoint every 2: OUT/ckpt_00000002.safetensors
//   blutrain launch -n 2 -- gen zero DATA OUT  the same under ZeRO-1 on 2 Gloo ranks: OUT/ckpt_00000002/
// with OMP_NUM_THREADS=1; losses.json holds both runs' losses. It is not part of the build.
#include <cstdio>
#include <iostream>
#include <string>
#include "blu/train/trainer.h"
#include "train/train_test_util.h"

using namespace blu;
int main(int argc, char** argv) {
  const std::string mode = argv[1];
  const std::filesystem::path data = argv[2], out = argv[3];
  train::TrainOptions o = train::test_util::toy_run(data, out, 64, "fp32");
  o.model["n_layer"] = 1; o.model["n_head"] = 2; o.model["n_embd"] = 16; o.model["block_size"] = 16;
  o.batch_size = 2; o.seq_len = 16; o.steps = 4; o.ckpt_every = 2; o.keep_last = 5; o.lr = 1e-2;
  o.val_pattern = "";
  if (mode == "zero") { o.dp = 2; o.zero = 1; }
  if (mode == "shards") { train::test_util::write_toy_shards(data, 64, 2048, 16384); return 0; }
  train::TrainCallbacks cb;
  cb.log = &std::cout;
  train::Trainer t(o, cb);
  t.run();
  return 0;
}
