#include "blu/io/global_tensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "blu/core/error.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace fs = std::filesystem;

namespace blu {

namespace {

int64_t product(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os.str() + ']';
}

// Calls f(global_element, piece_element, count) for each contiguous run of a box's elements.
template <class F>
void for_each_row(const std::vector<int64_t>& global, const std::vector<int64_t>& offset,
                  const std::vector<int64_t>& shape, F&& f) {
  const size_t nd = global.size();
  if (nd == 0) return f(0, 0, 1);
  if (product(shape) == 0) return;
  std::vector<int64_t> stride(nd, 1);
  for (size_t d = nd - 1; d-- > 0;) stride[d] = stride[d + 1] * global[d + 1];
  const int64_t row = shape[nd - 1], rows = product(shape) / row;
  std::vector<int64_t> idx(nd, 0);  // position in the piece (last dim stays 0)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t g = 0;
    for (size_t d = 0; d < nd; ++d) g += (offset[d] + idx[d]) * stride[d];
    f(g, r * row, row);
    for (size_t d = nd - 1; d-- > 0;) {  // next row: odometer over all dims but the last
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

std::string write_pieces(const std::string& dir, int rank, const std::vector<GlobalPiece>& pieces) {
  BLU_CHECK(rank >= 0, "write_pieces: rank must be >= 0, got ", rank);
  fs::create_directories(dir);
  SafeTensorsWriter w;
  std::vector<Tensor> keep;
  nlohmann::json index = nlohmann::json::array();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const GlobalPiece& p = pieces[i];
    BLU_CHECK(p.data.defined(), "write_pieces: piece ", i, " of '", p.name, "' has no data");
    const auto [it, fresh] = shapes.emplace(p.name, p.global_shape);
    BLU_CHECK(fresh || it->second == p.global_shape, "write_pieces: '", p.name, "' has pieces of global shapes ",
              shape_str(it->second), " and ", shape_str(p.global_shape));
    const std::vector<int64_t> shape = p.data.shape();
    if (p.offset.empty()) {
      BLU_CHECK(p.range_begin >= 0 && shape.size() == 1 && p.range_begin + shape[0] <= product(p.global_shape),
                "write_pieces: the range piece of '", p.name, "' at ", p.range_begin, " of ", shape_str(shape),
                " does not fit its global shape ", shape_str(p.global_shape), " (a range piece is 1-D)");
    } else {
      BLU_CHECK(p.offset.size() == p.global_shape.size() && shape.size() == p.global_shape.size(),
                "write_pieces: the box piece of '", p.name, "' has offset ", shape_str(p.offset), " and shape ",
                shape_str(shape), " for global shape ", shape_str(p.global_shape));
      for (size_t d = 0; d < shape.size(); ++d)
        BLU_CHECK(p.offset[d] >= 0 && p.offset[d] + shape[d] <= p.global_shape[d], "write_pieces: the piece of '",
                  p.name, "' at ", shape_str(p.offset), " of shape ", shape_str(shape), " leaves its global shape ",
                  shape_str(p.global_shape), " in dimension ", d);
    }
    Tensor c = contiguous(to_device(p.data.detach(), kCPU));
    keep.push_back(c);
    const std::string key = "piece." + std::to_string(i);
    w.add(key, c.dtype(), shape, {static_cast<const std::byte*>(c.raw_data()), c.nbytes()});
    nlohmann::json e = {{"key", key}, {"name", p.name}, {"global_shape", p.global_shape}};
    if (p.offset.empty()) e["range_begin"] = p.range_begin;
    else e["offset"] = p.offset;
    index.push_back(std::move(e));
  }
  w.set_metadata("format", "blutrain.global_tensors.v1");
  w.set_metadata("pieces", index.dump());
  std::ostringstream name;
  name << "pieces_" << std::setw(5) << std::setfill('0') << rank << ".safetensors";
  const std::string path = (fs::path(dir) / name.str()).string();
  w.write(path);
  return path;
}

struct GlobalTensorReader::Impl {
  struct Piece {
    size_t file;
    std::string key;
    std::vector<int64_t> offset;
    int64_t range_begin = -1;
  };
  struct Entry {
    std::vector<int64_t> global_shape;
    DType dtype;
    std::vector<Piece> pieces;
  };
  std::string dir;
  std::vector<SafeTensorsFile> files;
  std::map<std::string, Entry> entries;
  const Entry& at(const std::string& name) const {
    const auto it = entries.find(name);
    BLU_CHECK(it != entries.end(), "global tensors in ", dir, ": no tensor '", name, "'");
    return it->second;
  }
};

GlobalTensorReader::GlobalTensorReader(const std::string& dir) : impl_(std::make_unique<Impl>()) {
  impl_->dir = dir;
  std::vector<std::string> paths;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("pieces_", 0) == 0 && e.path().extension() == ".safetensors") paths.push_back(e.path().string());
  }
  BLU_CHECK(!ec, "global tensors: cannot read the directory ", dir, ": ", ec.message());
  BLU_CHECK(!paths.empty(), "global tensors: ", dir, " holds no pieces_*.safetensors");
  std::sort(paths.begin(), paths.end());
  for (const std::string& path : paths) {
    SafeTensorsFile f = SafeTensorsFile::open(path);
    const auto& md = f.metadata();
    BLU_CHECK(md.count("format") && md.at("format") == "blutrain.global_tensors.v1", path,
              ": not a global-tensor file (metadata format '", md.count("format") ? md.at("format") : "", "')");
    BLU_CHECK(md.count("pieces"), path, ": its metadata has no 'pieces' index");
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(md.at("pieces"));
    } catch (const nlohmann::json::exception& e) {
      BLU_CHECK(false, path, ": the 'pieces' index is not JSON: ", e.what());
    }
    const size_t fi = impl_->files.size();
    for (const auto& e : index) {
      try {
        Impl::Piece p{fi, e.at("key").get<std::string>(), {}, -1};
        if (e.contains("offset")) p.offset = e.at("offset").get<std::vector<int64_t>>();
        else p.range_begin = e.at("range_begin").get<int64_t>();
        const std::string name = e.at("name").get<std::string>();
        const auto gshape = e.at("global_shape").get<std::vector<int64_t>>();
        const TensorEntry& te = f.at(p.key);
        auto [it, fresh] = impl_->entries.emplace(name, Impl::Entry{gshape, te.dtype, {}});
        BLU_CHECK(it->second.global_shape == gshape && it->second.dtype == te.dtype, path, ": '", name,
                  "' has a piece of global shape ", shape_str(gshape), " ", te.dtype, ", others say ",
                  shape_str(it->second.global_shape), " ", it->second.dtype);
        // Where the piece lies must fit the global tensor (a hostile index must not write outside).
        if (p.offset.empty()) {
          BLU_CHECK(te.shape.size() == 1 && p.range_begin >= 0 &&
                        p.range_begin + te.shape[0] <= product(gshape),
                    path, ": the range piece ", p.key, " of '", name, "' does not fit ", shape_str(gshape));
        } else {
          BLU_CHECK(p.offset.size() == gshape.size() && te.shape.size() == gshape.size(), path, ": the piece ", p.key,
                    " of '", name, "' has offset ", shape_str(p.offset), " for ", shape_str(gshape));
          for (size_t d = 0; d < gshape.size(); ++d)
            BLU_CHECK(p.offset[d] >= 0 && p.offset[d] + te.shape[d] <= gshape[d], path, ": the piece ", p.key, " of '",
                      name, "' leaves ", shape_str(gshape), " in dimension ", d);
        }
        it->second.pieces.push_back(std::move(p));
      } catch (const nlohmann::json::exception& x) {
        BLU_CHECK(false, path, ": a malformed entry in the 'pieces' index: ", x.what());
      }
    }
    impl_->files.push_back(std::move(f));
  }
}

GlobalTensorReader::~GlobalTensorReader() = default;

std::vector<std::string> GlobalTensorReader::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : impl_->entries) out.push_back(n);
  return out;
}

bool GlobalTensorReader::contains(const std::string& name) const { return impl_->entries.count(name) > 0; }

const std::vector<int64_t>& GlobalTensorReader::global_shape(const std::string& name) const {
  return impl_->at(name).global_shape;
}

DType GlobalTensorReader::dtype(const std::string& name) const { return impl_->at(name).dtype; }

Tensor GlobalTensorReader::full(const std::string& name) const {
  const Impl::Entry& e = impl_->at(name);
  Tensor out = empty(Shape(e.global_shape), e.dtype);
  const size_t es = dtype_size(e.dtype);
  auto* dst = static_cast<std::byte*>(out.raw_data());
  const int64_t n = product(e.global_shape);
  std::vector<bool> seen(size_t(n), false);
  auto put = [&](int64_t g, const std::byte* src, int64_t count) {
    std::memcpy(dst + size_t(g) * es, src, size_t(count) * es);
    for (int64_t k = 0; k < count; ++k) seen[size_t(g + k)] = true;
  };
  for (const Impl::Piece& p : e.pieces) {
    const SafeTensorsFile& f = impl_->files[p.file];
    const TensorEntry& te = f.at(p.key);
    const std::byte* src = f.bytes(te).data();
    if (p.offset.empty()) {
      put(p.range_begin, src, te.shape[0]);
    } else {
      for_each_row(e.global_shape, p.offset, te.shape,
                   [&](int64_t g, int64_t local, int64_t count) { put(g, src + size_t(local) * es, count); });
    }
  }
  const auto miss = std::find(seen.begin(), seen.end(), false);
  BLU_CHECK(miss == seen.end(), "global tensors in ", impl_->dir, ": no piece holds element ", miss - seen.begin(),
            " of '", name, "' ", shape_str(e.global_shape), " (the checkpoint's ranks did not all write)");
  return out;
}

Tensor GlobalTensorReader::box(const std::string& name, const std::vector<int64_t>& offset,
                               const std::vector<int64_t>& shape) const {
  const Impl::Entry& e = impl_->at(name);
  BLU_CHECK(offset.size() == e.global_shape.size() && shape.size() == e.global_shape.size(), "global tensors: box ",
            shape_str(offset), " of ", shape_str(shape), " for '", name, "' ", shape_str(e.global_shape));
  Tensor t = full(name);
  for (size_t d = 0; d < shape.size(); ++d) {
    BLU_CHECK(offset[d] >= 0 && shape[d] >= 0 && offset[d] + shape[d] <= e.global_shape[d], "global tensors: box ",
              shape_str(offset), " of ", shape_str(shape), " leaves '", name, "' ", shape_str(e.global_shape));
    t = narrow(t, int64_t(d), offset[d], shape[d]);
  }
  return contiguous(t);
}

Tensor GlobalTensorReader::range(const std::string& name, int64_t begin, int64_t count) const {
  const Impl::Entry& e = impl_->at(name);
  const int64_t n = product(e.global_shape);
  BLU_CHECK(begin >= 0 && count >= 0 && begin + count <= n, "global tensors: range [", begin, ", ", begin + count,
            ") leaves '", name, "' of ", n, " elements");
  return contiguous(narrow(reshape(full(name), {n}), 0, begin, count));
}

}  // namespace blu
