// Global-coordinate pieces (io/global_tensors.h): a tensor written as column shards on 4 "ranks"
// reads back whole and as row shards of another layout; ZeRO-style flat ranges over several
// tensors read back as boxes; a missing piece, an inconsistent global shape and hostile offsets are
// refused by name.
#include <gtest/gtest.h>

#include <filesystem>

#include "blu/blu.h"
#include "blu/io/global_tensors.h"
#include "blu/io/safetensors.h"
#include "common/checks.h"
#include "dist/dist_test_util.h"

namespace blu {
namespace {

using blu::test::error_of;

Tensor ramp(const Shape& s, DType dt = DType::f32) {
  std::vector<double> v(size_t(numel(s)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i) * 0.5 - 3;
  return from_vector(v, s, dt);
}

TEST(GlobalTensors, ColumnShardsReadAsRowShards) {
  dist::test::TempDir dir;
  const Tensor w = ramp({6, 8});
  for (int r = 0; r < 4; ++r) {  // 4 ranks, each 2 columns (a column-parallel weight)
    write_pieces(dir.str(), r, {{"w", {6, 8}, {0, 2 * r}, -1, narrow(w, 1, 2 * r, 2)}});
  }
  const GlobalTensorReader rd(dir.str());
  EXPECT_EQ(rd.names(), std::vector<std::string>({"w"}));
  EXPECT_EQ(to_vector(rd.full("w")), to_vector(w));
  for (int r = 0; r < 3; ++r)  // read as 3 row shards
    EXPECT_EQ(to_vector(rd.box("w", {2 * r, 0}, {2, 8})), to_vector(narrow(w, 0, 2 * r, 2)));
  EXPECT_EQ(to_vector(rd.range("w", 5, 20)), to_vector(narrow(reshape(w, {48}), 0, 5, 20)));
}

TEST(GlobalTensors, FlatRangesOverSeveralTensors) {
  // ZeRO: two parameters flattened into one buffer of 24 + 10 elements, split over 3 ranks at
  // arbitrary boundaries; each rank writes the part of each parameter its range holds.
  dist::test::TempDir dir;
  const Tensor a = ramp({4, 6}, DType::bf16), b = ramp({10}, DType::bf16);
  const int64_t cuts[] = {0, 11, 27, 34};
  for (int r = 0; r < 3; ++r) {
    std::vector<GlobalPiece> mine;
    const int64_t lo = cuts[r], hi = cuts[r + 1];
    if (lo < 24) mine.push_back({"a", {4, 6}, {}, lo, narrow(reshape(a, {24}), 0, lo, std::min<int64_t>(hi, 24) - lo)});
    if (hi > 24) mine.push_back({"b", {10}, {}, std::max<int64_t>(lo, 24) - 24,
                                 narrow(b, 0, std::max<int64_t>(lo, 24) - 24, hi - std::max<int64_t>(lo, 24))});
    write_pieces(dir.str(), r, mine);
  }
  const GlobalTensorReader rd(dir.str());
  EXPECT_EQ(rd.dtype("a"), DType::bf16);
  EXPECT_EQ(to_vector(rd.full("a")), to_vector(a));
  EXPECT_EQ(to_vector(rd.full("b")), to_vector(b));
  EXPECT_EQ(to_vector(rd.box("a", {1, 2}, {2, 3})), to_vector(contiguous(narrow(narrow(a, 0, 1, 2), 1, 2, 3))));
}

TEST(GlobalTensors, RefusesWhatDoesNotAddUp) {
  dist::test::TempDir dir;
  const Tensor w = ramp({4, 4});
  write_pieces(dir.str(), 0, {{"w", {4, 4}, {0, 0}, -1, narrow(w, 0, 0, 2)}});  // rank 1 never wrote
  EXPECT_NE(error_of([&] { GlobalTensorReader(dir.str()).full("w"); }).find("no piece holds element 8 of 'w'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { GlobalTensorReader(dir.str()).full("v"); }).find("no tensor 'v'"), std::string::npos);
  EXPECT_NE(error_of([&] { write_pieces(dir.str(), 1, {{"w", {4, 4}, {3, 0}, -1, narrow(w, 0, 0, 2)}}); })
                .find("leaves its global shape [4, 4] in dimension 0"),
            std::string::npos);
  write_pieces(dir.str(), 1, {{"w", {4, 5}, {2, 0}, -1, narrow(w, 0, 2, 2)}});
  EXPECT_NE(error_of([&] { GlobalTensorReader{dir.str()}; }).find("'w' has a piece of global shape [4, 5]"),
            std::string::npos);
  dist::test::TempDir empty_dir;
  EXPECT_NE(error_of([&] { GlobalTensorReader{empty_dir.str()}; }).find("holds no pieces_"), std::string::npos);
  // A hostile index: a piece claiming to lie outside its tensor.
  dist::test::TempDir bad;
  SafeTensorsWriter sw;
  const Tensor p = ramp({2, 2});
  sw.add("piece.0", DType::f32, {2, 2}, {static_cast<const std::byte*>(p.raw_data()), p.nbytes()});
  sw.set_metadata("format", "blutrain.global_tensors.v1");
  sw.set_metadata("pieces", R"([{"key":"piece.0","name":"w","global_shape":[2,2],"offset":[1000000,0]}])");
  sw.write(bad.str() + "/pieces_00000.safetensors");
  EXPECT_NE(error_of([&] { GlobalTensorReader{bad.str()}; }).find("leaves [2, 2] in dimension 0"), std::string::npos);
}

}  // namespace
}  // namespace blu
