// ops/precision: the matmul precision setting (set_matmul_precision, "ieee"/"tf32") as the ops
// layer's callers name it; the setting itself lives in core/precision.h, where the backends read it.
// Depends on core/precision. Keep: only a re-export, no definitions of its own.
#pragma once
#include "blu/core/precision.h"
