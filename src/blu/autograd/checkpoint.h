// autograd/checkpoint: recompute regions (activation checkpointing). checkpoint(name, fn, inputs)
// runs fn on the inputs with grad mode off — none of fn's ops saves anything — and records one
// node over the inputs whose backward runs fn again with grad mode on, on leaves standing for the
// inputs, and back-propagates the output's gradient through that rebuilt graph (a nested
// backward): the parameters fn reads get their gradients as in a plain backward (through their
// own accumulators, hooks included) and the inputs' gradients are what the node returns.
// Random numbers: the states of `generators` (and of the default generator) are taken before the
// first run and restored around the rebuild, so dropout draws the same masks both times; after
// the rebuild every generator is back where it was.
// drop_output (selective recompute): the region's output is not kept either — a later op that
// saves it (the projection after an attention core) gets, through recompute_pack_hook(), a box
// that rebuilds the region when its backward needs the value; the region's own backward then uses
// that same rebuilt graph, so the region runs twice in all (forward, and once in backward).
// Depends on autograd/{function,saved_hooks,engine}, core/rng. Keep: with the same kernels the
// rebuilt output and every gradient are bitwise those of running fn plainly (the same ops in the
// same order on the same values); the node saves only the inputs (through the saved-tensor hooks,
// so they can go to host memory); a region in which no input requires grad is run plainly.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "blu/autograd/saved_hooks.h"
#include "blu/core/rng.h"
#include "blu/core/tensor.h"

namespace blu {

using RegionFn = std::function<Tensor(const std::vector<Tensor>& inputs)>;

// fn(inputs) as a recompute region (above). With grad mode off, or when no input requires grad:
// fn(inputs) itself.
Tensor checkpoint(std::string name, const RegionFn& fn, const std::vector<Tensor>& inputs,
                  const std::vector<Generator*>& generators = {}, bool drop_output = false);

// The pack hook that boxes a saved tensor viewing a drop_output region's output as "rebuild the
// region" (declines every other tensor). Open it (SavedTensorHooks) around the code that calls
// checkpoint(…, drop_output = true) and the ops that consume the output.
PackHook recompute_pack_hook();

// How many regions this thread has rebuilt (for tests: a region runs again once per backward).
int64_t recompute_rebuild_count();

}  // namespace blu
