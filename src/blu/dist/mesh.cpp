#include "blu/dist/mesh.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "blu/core/error.h"

namespace blu::dist {

GroupFactory gloo_group_factory(GlooOptions options) {
  return [options](TcpStore& store, int rank, int size, const std::string& prefix) {
    GlooOptions o = options;
    o.prefix = prefix;
    return make_gloo_group(store, rank, size, o);
  };
}

GroupFactory nccl_group_factory(NcclOptions options) {
#ifdef BLU_HAVE_CUDA
  return [options](TcpStore& store, int rank, int size, const std::string& prefix) {
    NcclOptions o = options;
    o.prefix = prefix;
    return make_nccl_group(store, rank, size, o);
  };
#else
  (void)options;
  BLU_CHECK(false, "DeviceMesh: NCCL groups need a CUDA build (this one has none); use Gloo on the CPU");
  return {};
#endif
}

DeviceMesh::DeviceMesh(int rank, int world_size, std::vector<MeshDim> dims)
    : rank_(rank), world_size_(world_size), dims_(std::move(dims)) {
  BLU_CHECK(!dims_.empty() && dims_.size() <= 8, "DeviceMesh: expected 1 to 8 dimensions, got ", dims_.size());
  int64_t product = 1;
  for (size_t i = 0; i < dims_.size(); ++i) {
    const MeshDim& d = dims_[i];
    const bool word = !d.name.empty() && std::all_of(d.name.begin(), d.name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
    });
    BLU_CHECK(word, "DeviceMesh: dimension ", i, " has the name '", d.name,
              "' (expected letters, digits and '_', e.g. \"dp\")");
    BLU_CHECK(d.size >= 1, "DeviceMesh: dimension '", d.name, "' has size ", d.size, " (expected at least 1)");
    for (size_t j = 0; j < i; ++j)
      BLU_CHECK(dims_[j].name != d.name, "DeviceMesh: dimension '", d.name, "' is named twice");
    product *= d.size;
  }
  BLU_CHECK(product == world_size, "DeviceMesh: ", describe(), " has ", product, " ranks, the job has ", world_size);
  BLU_CHECK(rank >= 0 && rank < world_size, "DeviceMesh: rank ", rank, " is outside [0, ", world_size, ")");
}

DeviceMesh::DeviceMesh(TcpStore& store, int rank, int world_size, std::vector<MeshDim> dims,
                       const GroupFactory& make_group)
    : DeviceMesh(rank, world_size, std::move(dims)) {
  const uint32_t n = uint32_t(dims_.size());
  for (uint32_t mask = 1; mask < (1u << n); ++mask) {
    const std::vector<int> members = ranks_in(mask, rank_);
    std::ostringstream prefix;
    prefix << "mesh/";
    for (uint32_t d = 0; d < n; ++d)
      if (mask >> d & 1u) prefix << dims_[d].name << '.';
    prefix << '/';
    const std::vector<int> c = coordinates(rank_);
    for (uint32_t d = 0; d < n; ++d)  // the coordinates the group's members share
      if (!(mask >> d & 1u)) prefix << dims_[d].name << c[d] << '.';
    const int my = int(std::find(members.begin(), members.end(), rank_) - members.begin());
    groups_[mask] = make_group(store, my, int(members.size()), prefix.str());
  }
}

std::string DeviceMesh::describe() const {
  std::ostringstream os;
  for (size_t i = 0; i < dims_.size(); ++i) os << (i ? " × " : "") << dims_[i].name << '=' << dims_[i].size;
  return os.str();
}

int DeviceMesh::index_of(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].name == dim) return int(i);
  std::string names;
  for (const MeshDim& d : dims_) names += (names.empty() ? "" : ", ") + d.name;
  BLU_CHECK(false, "DeviceMesh: no dimension '", dim, "' (the mesh has ", names, ")");
  return -1;
}

int DeviceMesh::size(const std::string& dim) const { return dims_[size_t(index_of(dim))].size; }

int DeviceMesh::coordinate(const std::string& dim) const { return coordinates(rank_)[size_t(index_of(dim))]; }

std::vector<int> DeviceMesh::coordinates(int rank) const {
  BLU_CHECK(rank >= 0 && rank < world_size_, "DeviceMesh: rank ", rank, " is outside [0, ", world_size_, ")");
  std::vector<int> c(dims_.size());
  for (size_t i = dims_.size(); i-- > 0;) {
    c[i] = rank % dims_[i].size;
    rank /= dims_[i].size;
  }
  return c;
}

int DeviceMesh::rank_at(const std::vector<int>& c) const {
  BLU_CHECK(c.size() == dims_.size(), "DeviceMesh: expected ", dims_.size(), " coordinates, got ", c.size());
  int r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    BLU_CHECK(c[i] >= 0 && c[i] < dims_[i].size, "DeviceMesh: coordinate ", c[i], " of '", dims_[i].name,
              "' is outside [0, ", dims_[i].size, ")");
    r = r * dims_[i].size + c[i];
  }
  return r;
}

uint32_t DeviceMesh::mask_of(const std::vector<std::string>& dims) const {
  BLU_CHECK(!dims.empty(), "DeviceMesh: a group needs at least one dimension");
  uint32_t mask = 0;
  for (const std::string& d : dims) mask |= 1u << index_of(d);
  return mask;
}

std::vector<int> DeviceMesh::ranks_in(uint32_t mask, int rank) const {
  // Every rank whose coordinates outside `mask` equal `rank`'s, in row-major order over the mask.
  const std::vector<int> base = coordinates(rank);
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    const std::vector<int> c = coordinates(r);
    bool same = true;
    for (size_t d = 0; d < dims_.size() && same; ++d) same = (mask >> d & 1u) || c[d] == base[d];
    if (same) out.push_back(r);
  }
  return out;
}

std::vector<int> DeviceMesh::group_ranks(const std::vector<std::string>& dims) const {
  return ranks_in(mask_of(dims), rank_);
}

std::shared_ptr<ProcessGroup> DeviceMesh::group_ptr(const std::vector<std::string>& dims) const {
  const auto it = groups_.find(mask_of(dims));
  BLU_CHECK(it != groups_.end(), "DeviceMesh: ", describe(), " was built without process groups");
  return it->second;
}

ProcessGroup& DeviceMesh::group(const std::vector<std::string>& dims) const { return *group_ptr(dims); }

ProcessGroup& DeviceMesh::group(const std::string& dim) const { return group(std::vector<std::string>{dim}); }

ProcessGroup& DeviceMesh::world() const {
  std::vector<std::string> all;
  for (const MeshDim& d : dims_) all.push_back(d.name);
  return group(all);
}

}  // namespace blu::dist
