// train/tb_events: TensorBoard event files of a run's metrics, so `tensorboard --logdir` can show
// runs too. An event file is a TFRecord stream (per record: uint64 length, masked CRC32C of the
// length, the bytes, masked CRC32C of the bytes; little-endian) of tensorflow.Event protobufs:
// first one holding file_version "brain.Event:2", then one per step holding that step's scalars
// (Summary.Value: tag, simple_value). The handful of protobuf fields needed are encoded by hand
// here (varint, fixed64 double, fixed32 float, length-delimited), so no protobuf library is needed.
// Depends on train/report (the plotted series, so TensorBoard shows what the page shows).
// Keep: the tags are the report's plot ids ("loss/train", "loss/val", "loss/bigram_baseline", "lr",
// "grad_norm", "tok_per_s", "mfu" in %, "memory" in MiB); a file is written atomically.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "blu/train/report.h"

namespace blu::train {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc`.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// TFRecord's mask: rotate right by 15 and add 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);
// One TFRecord around `payload`.
std::string tfrecord(const std::string& payload);

struct TbScalar {
  std::string tag;
  float value = 0;
};
// A serialized tensorflow.Event: wall_time, step and a summary of `scalars`.
std::string tb_scalar_event(double wall_time, int64_t step, const std::vector<TbScalar>& scalars);
// A serialized tensorflow.Event with file_version "brain.Event:2", which opens every event file.
std::string tb_file_version_event(double wall_time);

// The event file's contents for one run: wall times are the run's start (metrics.jsonl's
// modification time less the recorded step times) plus the step times up to each step.
std::string tb_event_file(const RunData& run);
// Writes <out>/<run name>/events.out.tfevents.blutrain for each run (replacing the one a previous
// report wrote); returns the files.
std::vector<std::filesystem::path> write_tensorboard(const std::vector<RunData>& runs,
                                                     const std::filesystem::path& out);

}  // namespace blu::train
