// ops/meta_dispatch: dispatch without kernels, for compiler capture (Note [Meta dispatch]).
// Depends on nothing but the standard library; implemented in ops/dispatch.cpp. Keep: per thread;
// guards nest.
#pragma once

namespace blu {

// Note [Meta dispatch]
// Compiler capture (compiler/capture.h) records a whole training step without computing it: while
// a MetaDispatchGuard lives on this thread, dispatch (ops/dispatch.h) checks the arguments, runs
// the op's shape rule and its view function, makes each fresh output over an unbacked Storage (the
// output's byte count, no bytes: Storage::ptr() is null), bumps the versions an in-place op would,
// tells the observers and records autograd — but runs no kernel. The host logic around the ops
// (autograd's engine, optimizer counters, DDP's hooks) therefore runs exactly as in an eager step.
// Whoever owns the capture gives the unbacked storages their bytes afterwards (Storage::data) and
// runs the kernels. Reading an unbacked tensor's values on the host is an error of the caller.
bool meta_dispatch();
class MetaDispatchGuard {
 public:
  explicit MetaDispatchGuard(bool on = true);  // off: real dispatch inside a meta region
  ~MetaDispatchGuard();
  MetaDispatchGuard(const MetaDispatchGuard&) = delete;
  MetaDispatchGuard& operator=(const MetaDispatchGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace blu
