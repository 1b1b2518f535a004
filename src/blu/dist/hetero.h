// dist/hetero: uneven work for uneven hardware (Whale's hardware-aware splits). A short probe at
// start-up measures each rank's speed on the model itself; the splitters turn speeds (measured, or
// stated in the config) into
//   replica batch sizes proportional to speed (the gradient average is then weighted by each
//   replica's share of the batch, so the update is the same as with an even split),
//   pipeline stage block counts that minimise the slowest stage's time under each stage's memory,
//   tensor-parallel shard widths proportional to speed, in whole heads or rows.
// Depends on dist/process_group, models/causal_lm. Keep: the splitters are pure functions (every
// rank computes the same split from the same all-gathered speeds); every share is at least one
// unit, and a split that cannot satisfy that or the memory limits is an error, never a silent
// even split.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/models/causal_lm.h"

namespace blu::dist {

// Each rank's forward + backward time of `model` on b sequences of length T (median of `reps`
// after a warm-up), all-gathered: the same vector on every rank, in rank order. Collective.
std::vector<double> probe_step_times(models::CausalLM& model, ProcessGroup& pg, int64_t b, int64_t T, int reps = 3);
// Every rank's `mine`, in rank order (an all-gather of one f64 on the group's device: `dev` for
// NCCL, the CPU for Gloo). Collective.
std::vector<double> gather_values(ProcessGroup& pg, double mine, Device dev);
// Speeds (1 / time) normalised to sum to 1.
std::vector<double> speeds_from_times(const std::vector<double>& seconds);

// `total` units split in proportion to `weights` (largest remainder; ties to the lower index),
// then each part raised to `min_each` with units from the largest part. BLU_CHECK when
// total < min_each · parts or a weight is not positive.
std::vector<int64_t> proportional_split(int64_t total, const std::vector<double>& weights, int64_t min_each = 1);

// Contiguous block ranges [first, last] for stages of the given speeds that minimise the slowest
// stage's time: a stage runs its blocks at block_seconds / speed each, the first stage also the
// embedding (first_seconds / speed) and the last the head and loss (last_seconds / speed).
// `max_blocks[s]` (empty: no limit) bounds stage s by its memory. Exact (dynamic programming over
// the block count). BLU_CHECK when no split fits.
std::vector<std::pair<int64_t, int64_t>> balance_stages(int64_t blocks, const std::vector<double>& speeds,
                                                        double block_seconds, double first_seconds,
                                                        double last_seconds,
                                                        const std::vector<int64_t>& max_blocks = {});

}  // namespace blu::dist
