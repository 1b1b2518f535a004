// blu/blu.h: everything a user of the tensor library needs — tensors, ops, autograd.
#pragma once
#include "blu/core/grad_mode.h"
#include "blu/core/rng.h"
#include "blu/core/tensor.h"
#include "blu/memory/allocator.h"
#include "blu/ops/attention.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
