// core/reduction: how a loss folds its per-element values — none (one value each), mean or sum —
// as torch.nn.functional's `reduction`. The ops (ops/nn.h's cross_entropy) take it as an argument
// and pass it to the kernels as the integer attribute "reduction"; the backends read it back.
// Depends on nothing. Keep: the enumerators' values are the attribute's wire values (kernels
// convert with Reduction(attrs.i("reduction"))).
#pragma once

namespace blu {

enum class Reduction { none, mean, sum };

}  // namespace blu
