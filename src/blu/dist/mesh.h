// dist/mesh: the job's ranks as an N-dimensional grid — for example dp × pp × tp — with one process
// group for every dimension and every sub-mesh (every non-empty set of dimensions), so a layout asks
// for "the tp group" or "the dp×tp group" by name instead of computing rank lists.
// Rank order is row-major over the dimensions as given: the last dimension varies fastest, so the
// ranks of the innermost dimension (tensor parallelism, by convention) are neighbours — the same
// node when ranks are numbered node by node.
// Every group is created at construction, eagerly and in one fixed order on every rank (sub-meshes
// by increasing bit mask of their dimensions); a rank creates only the groups it belongs to, each
// under its own store prefix ("mesh/<dims>/<fixed coordinates>"). Creating groups lazily, in an
// order that depends on which code path a rank took, is how jobs hang at start-up.
// Depends on dist/process_group, dist/tcp_store. Keep: the product of the sizes is the world size;
// names are unique; groups are never created after construction.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/dist/tcp_store.h"

namespace blu::dist {

struct MeshDim {
  std::string name;  // "dp", "pp", "tp", …: letters, digits and '_'
  int size = 1;
};

// Makes one group: this rank's rank in it, its size, and the store prefix that keeps it apart.
using GroupFactory =
    std::function<std::shared_ptr<ProcessGroup>(TcpStore& store, int rank, int size, const std::string& prefix)>;
// Gloo groups with `options` (prefix replaced per group).
GroupFactory gloo_group_factory(GlooOptions options = {});
// NCCL groups with `options` (prefix replaced per group); CUDA builds only.
GroupFactory nccl_group_factory(NcclOptions options = {});

class DeviceMesh {
 public:
  // `rank` of the job's `world_size()` = product of the sizes. BLU_CHECK on a size below 1, a
  // repeated or malformed name, or a product other than `world_size`. Creates every group.
  DeviceMesh(TcpStore& store, int rank, int world_size, std::vector<MeshDim> dims, const GroupFactory& make_group);
  // The grid alone, without groups: coordinates and rank lists (what planners and tests use).
  DeviceMesh(int rank, int world_size, std::vector<MeshDim> dims);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::vector<MeshDim>& dims() const { return dims_; }
  // "dp=2 × pp=2 × tp=2"
  std::string describe() const;
  int size(const std::string& dim) const;       // BLU_CHECK on an unknown name
  int coordinate(const std::string& dim) const;  // this rank's
  std::vector<int> coordinates(int rank) const;  // any rank's, one per dimension
  int rank_at(const std::vector<int>& coordinates) const;
  // The ranks of this rank's group along `dims` (in the group's rank order: row-major over them).
  std::vector<int> group_ranks(const std::vector<std::string>& dims) const;

  // This rank's group along one dimension, or along a sub-mesh of several (any order; the group is
  // the same). BLU_CHECK on an unknown name or a mesh built without groups.
  ProcessGroup& group(const std::string& dim) const;
  ProcessGroup& group(const std::vector<std::string>& dims) const;
  std::shared_ptr<ProcessGroup> group_ptr(const std::vector<std::string>& dims) const;
  // The whole job (all dimensions).
  ProcessGroup& world() const;

 private:
  int index_of(const std::string& dim) const;
  uint32_t mask_of(const std::vector<std::string>& dims) const;
  std::vector<int> ranks_in(uint32_t mask, int rank) const;
  int rank_;
  int world_size_;
  std::vector<MeshDim> dims_;
  std::map<uint32_t, std::shared_ptr<ProcessGroup>> groups_;  // by mask of dimensions
};

}  // namespace blu::dist
