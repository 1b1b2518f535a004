// The device mesh (dist/mesh.h): row-major coordinates, group membership per dimension and
// sub-mesh, bad shapes refused; and, as 8 Gloo ranks of a 2 × 2 × 2 mesh, every group of every rank
// reduces over exactly the ranks group_ranks names.
#include <gtest/gtest.h>

#include "blu/dist/mesh.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist {
namespace {

using blu::test::error_of;

TEST(DeviceMesh, CoordinatesAreRowMajor) {
  const DeviceMesh m(5, 8, {{"dp", 2}, {"pp", 2}, {"tp", 2}});
  EXPECT_EQ(m.coordinates(5), std::vector<int>({1, 0, 1}));
  EXPECT_EQ(m.coordinate("dp"), 1);
  EXPECT_EQ(m.coordinate("tp"), 1);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(m.rank_at(m.coordinates(r)), r);
  EXPECT_EQ(m.group_ranks({"tp"}), std::vector<int>({4, 5}));  // the innermost dimension: neighbours
  EXPECT_EQ(m.group_ranks({"pp"}), std::vector<int>({5, 7}));
  EXPECT_EQ(m.group_ranks({"dp"}), std::vector<int>({1, 5}));
  EXPECT_EQ(m.group_ranks({"tp", "dp"}), std::vector<int>({0, 1, 4, 5}));
  EXPECT_EQ(m.group_ranks({"dp", "pp", "tp"}).size(), 8u);
  EXPECT_EQ(m.describe(), "dp=2 × pp=2 × tp=2");
  EXPECT_EQ(m.size("pp"), 2);
}

TEST(DeviceMesh, BadShapesAreRefused) {
  auto refused = [](auto f, const std::string& part) {
    const std::string e = error_of(f);
    EXPECT_NE(e.find(part), std::string::npos) << e;
  };
  refused([] { DeviceMesh(0, 8, {{"dp", 2}, {"tp", 2}}); }, "dp=2 × tp=2 has 4 ranks, the job has 8");
  refused([] { DeviceMesh(0, 4, {{"dp", 2}, {"dp", 2}}); }, "'dp' is named twice");
  refused([] { DeviceMesh(0, 4, {{"dp", 0}, {"tp", 2}}); }, "'dp' has size 0");
  refused([] { DeviceMesh(0, 4, {{"d p", 4}}); }, "the name 'd p'");
  refused([] { DeviceMesh(4, 4, {{"dp", 4}}); }, "rank 4 is outside [0, 4)");
  const DeviceMesh m(0, 4, {{"dp", 2}, {"tp", 2}});
  refused([&] { m.size("pp"); }, "no dimension 'pp' (the mesh has dp, tp)");
  refused([&] { m.group("tp"); }, "built without process groups");
  refused([&] { m.rank_at({0, 2}); }, "coordinate 2 of 'tp'");
}

TEST(DeviceMesh, GroupsOverGloo) {
  const auto r = test::run_workers("mesh", 8);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

}  // namespace
}  // namespace blu::dist
