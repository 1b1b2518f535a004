// io/global_tensors: state saved as pieces of global tensors, each piece with its place in the
// whole — a box (an offset per dimension: a tensor-parallel shard, a pipeline stage's whole
// layer) or a range of the tensor's row-major elements (ZeRO's flat shards) — so what one layout
// wrote, any other layout and world size can read: each reader asks for the tensors (or the box or
// range of them) it holds now.
//   write_pieces(dir, rank, pieces): this rank's pieces in dir/pieces_RRRRR.safetensors, written
//     atomically (temp, fsync, rename, directory fsync), the index of pieces in its metadata;
//   GlobalTensorReader(dir): every rank's file of a directory, indexed by global name; full(),
//     box() and range() assemble what is asked from whichever pieces cover it, and refuse (naming
//     the tensor and the first element) what no piece covers, and pieces that disagree on a
//     tensor's global shape or dtype.
// Readers hold one assembled tensor at a time: a layout loads parameter by parameter, so its peak
// is the largest tensor, not the model.
// Depends on core/, io/safetensors, ops/ (copies to and from the host). Keep: pieces are written as
// they are (no conversion), a tensor's pieces together cover it exactly once or the read fails.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

struct GlobalPiece {
  std::string name;                   // the global tensor's name
  std::vector<int64_t> global_shape;  // the whole tensor's shape
  std::vector<int64_t> offset;        // a box: where data starts in each dimension (empty: a range)
  int64_t range_begin = -1;           // a range: the first row-major element (data is 1-D)
  Tensor data;                        // the piece (any device; copied to the host to write)
};

// Writes `pieces` as rank `rank`'s file of `dir` (created if missing). BLU_CHECK on a piece that
// does not fit its global shape or names a tensor twice with different global shapes.
std::string write_pieces(const std::string& dir, int rank, const std::vector<GlobalPiece>& pieces);

class GlobalTensorReader {
 public:
  // Opens every pieces_*.safetensors in dir. BLU_CHECK when there are none or a file is invalid.
  explicit GlobalTensorReader(const std::string& dir);
  ~GlobalTensorReader();
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const std::vector<int64_t>& global_shape(const std::string& name) const;
  DType dtype(const std::string& name) const;
  // The whole tensor on the CPU.
  Tensor full(const std::string& name) const;
  // The box at `offset` of `shape` (a tensor-parallel shard), on the CPU.
  Tensor box(const std::string& name, const std::vector<int64_t>& offset, const std::vector<int64_t>& shape) const;
  // Elements [begin, begin + count) of the row-major tensor, 1-D, on the CPU (a ZeRO shard).
  Tensor range(const std::string& name, int64_t begin, int64_t count) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace blu
