// compiler/graph: one captured training step as a plain C++ SSA graph — the form every compiler
// pass reads (memory plan, the MLIR lowering in compiler/mlir/, the runtime's launch list).
//   Buffer: a block of bytes on one device (one Storage in eager terms). Views and in-place
//     updates share a buffer; the memory plan places buffers, not values.
//   Value:  a strided view of a buffer (shape, strides, offset in elements, dtype, device), defined
//     once — by an op's output or as a graph input — and never redefined (SSA). An in-place update
//     defines a new value over the same buffer.
//   Op:     one dispatch call (its OpDef name and Attrs), or an opaque collective, with explicit
//     effects: which output is a view of which input, which inputs it writes in place.
// The graph holds no tensors and runs nothing: capture (compiler/capture.h) builds it, the runtime
// (compiler/runtime.h) binds it to memory.
// Depends on core/ (Shape, DType, Device, Attrs). Keep: small and stable — fields are added, never
// renamed; ids are indices (values[id].id == id, ops in schedule order); every op input is a value
// defined earlier in `ops` or a graph input; a view or in-place output shares its input's buffer.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "blu/core/attrs.h"
#include "blu/core/device.h"
#include "blu/core/dtype.h"
#include "blu/core/shape.h"

namespace blu {
class Tensor;
struct OpDef;
}  // namespace blu

namespace blu::compiler {

// What a buffer holds across steps. Everything but `temporary` is a graph input or outlives the
// step, and is placed once (never shares bytes with another buffer).
enum class BufferKind : uint8_t {
  temporary,        // made and dead within the step: the memory plan packs these by liveness
  parameter,        // a trained weight (updated in place by the optimizer)
  gradient,         // a gradient buffer that outlives the step (DDP's buckets, grad slots)
  optimizer_state,  // AdamW moments and the like
  step_input,       // this step's batch (token ids, targets): new data every step, same shape
  rng_state,        // Philox seed and offset inputs (see Op::rng)
  constant,         // any other tensor made before the step and only read by it
  step_output,      // made in the step and read after it (the loss, the gradient norm)
};
const char* buffer_kind_name(BufferKind k);

struct Buffer {
  int id = -1;
  size_t nbytes = 0;
  Device device;
  BufferKind kind = BufferKind::temporary;
  std::string name;  // parameters, gradients and state: the parameter's name; otherwise ""
};

struct Value {
  int id = -1;
  int buffer = -1;
  Shape shape, strides;  // strides in elements
  int64_t offset = 0;    // in elements, into the buffer
  DType dtype = DType::f32;
  Device device;
  int producer = -1;     // the op that defines it; -1: a graph input
  bool contiguous() const;
  size_t nbytes() const;  // numel × dtype size (the bytes a contiguous view covers)
};

enum class OpKind : uint8_t {
  kernel,      // a dispatch call that runs its backend kernel
  view,        // a dispatch call whose outputs are views of its inputs (no kernel)
  collective,  // a process-group operation (all-reduce, reduce-scatter, …): opaque, in place
  fused,       // a fused region made by a compiler pass (compiler/mlir/): `region` names it
};
const char* op_kind_name(OpKind k);

struct Op {
  OpKind kind = OpKind::kernel;
  std::string name;               // the OpDef's name ("matmul"), or the collective's ("all_reduce")
  const OpDef* def = nullptr;     // kernel and view ops: the definition dispatch ran
  Attrs attrs;
  std::vector<int> inputs;        // value ids; -1 where an optional input was undefined
  std::vector<int> outputs;       // value ids
  // Effects. views: (output j, input i) — output j is a view of input i's buffer. writes: the
  // inputs whose buffers the op writes in place (the in-place output, when there is one, is a
  // view of the first of them).
  std::vector<std::pair<int, int>> views;
  std::vector<int> writes;
  // Ops that draw from Philox (dropout): the attrs named "seed" and "offset" come from the
  // generator at capture; rng is true so a replay can supply them per step.
  bool rng = false;
  int region = -1;                // fused ops: the region's index in the pass that made it
  // Collectives: how the runtime replays it on its bound inputs (captures the process group).
  std::function<void(std::span<const Tensor> in)> call;
};

struct Graph {
  std::vector<Buffer> buffers;
  std::vector<Value> values;
  std::vector<Op> ops;            // in schedule (capture) order
  std::vector<int> inputs;        // value ids read by the step that no op defines
  std::vector<int> outputs;       // value ids read after the step (step outputs, grads kept)

  int add_buffer(Buffer b);
  int add_value(Value v);
  // Ops by kind, values, buffers and bytes: "312 ops (288 kernel, 20 view, 4 collective), …".
  std::string summary() const;
  // One line per buffer, value and op, e.g.
  //   %12 = matmul(%3, %7) {transpose_b=1} : [8, 64] f32 buf7
  // Stable: the same capture dumps the same text (tests compare dumps).
  std::string dump() const;
  // A hash of everything replay depends on except the attributes that are per-step kernel
  // arguments (float scalars such as lr; the ints named step, seed, offset): op names and kinds,
  // wiring, effects, every value's shape/strides/offset/dtype/device, buffer sizes and kinds. Two captures with equal signatures replay with the same plan.
  uint64_t structure_hash() const;
};

// The buffers `op` writes: those of its fresh outputs (not views) and of the inputs it updates in
// place (a buffer may be listed twice).
std::vector<int> written_buffers(const Graph& g, const Op& op);

// Whether an attribute belongs to the structure (structure_hash, the streamed replay's op check):
// its name always; its value unless it is a per-step kernel argument — a float scalar, or one of
// the ints named step, seed, offset.
inline bool per_step_argument(std::string_view key, const AttrValue& v) {
  return std::holds_alternative<double>(v) ||
         (std::holds_alternative<int64_t>(v) && (key == "step" || key == "seed" || key == "offset"));
}

}  // namespace blu::compiler
