// core/grad_mode: whether ops record autograd history on this thread. `NoGradGuard` turns it off
// for a scope (evaluation, optimizer updates). Depends on nothing.
#pragma once

namespace blu {

struct GradMode {
  static bool enabled();
  static void set_enabled(bool on);
};

class NoGradGuard {
 public:
  NoGradGuard() : prev_(GradMode::enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace blu
