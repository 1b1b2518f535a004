// optim/schedule: learning rate as a function of the step (warmup, then constant/cosine/linear).
#include <cmath>
#include <numbers>

#include "blu/optim/optimizer.h"

namespace blu::optim {

double LRSchedule::at(int64_t step) const {
  BLU_CHECK(step >= 0, "LRSchedule::at: step must be >= 0, got ", step);
  BLU_CHECK(warmup_steps >= 0, "LRSchedule: warmup_steps must be >= 0, got ", warmup_steps);
  if (step < warmup_steps) return max_lr * double(step + 1) / double(warmup_steps);
  if (kind == Kind::constant) return max_lr;
  if (step >= total_steps) return min_lr;
  // Here warmup_steps <= step < total_steps, so the span is positive.
  const double ratio = double(step - warmup_steps) / double(total_steps - warmup_steps);
  if (kind == Kind::linear) return max_lr + ratio * (min_lr - max_lr);
  const double coeff = 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));  // 1 → 0
  return min_lr + coeff * (max_lr - min_lr);
}

LRSchedule::Kind LRSchedule::parse(const std::string& name) {
  if (name == "constant") return Kind::constant;
  if (name == "cosine") return Kind::cosine;
  if (name == "linear") return Kind::linear;
  BLU_CHECK(false, "unknown learning-rate schedule '", name, "', expected constant, cosine or linear");
  return Kind::constant;  // unreachable
}

}  // namespace blu::optim
