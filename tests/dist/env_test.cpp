// dist/env: launcher variables and their checks.
#include <gtest/gtest.h>

#include <map>

#include "blu/dist/env.h"
#include "blu/core/error.h"

namespace blu::dist {
namespace {

DistEnv from(const std::map<std::string, std::string>& vars) {
  return detect_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

TEST(DistEnv, NoLauncherIsRankZeroOfOne) {
  const DistEnv e = from({});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.source, "none");
  EXPECT_FALSE(e.is_distributed());
}

TEST(DistEnv, Torchrun) {
  const DistEnv e = from({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"},
                          {"MASTER_PORT", "1234"}});
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_EQ(e.source, "torchrun");
}

TEST(DistEnv, DistTimeoutIsAPositiveNumberOfSeconds) {
  EXPECT_EQ(from({}).dist_timeout_s, 0.0);
  EXPECT_EQ(from({{"BLU_DIST_TIMEOUT", "2.5"}}).dist_timeout_s, 2.5);
  for (const char* bad : {"0", "-3", "ten", "", "1e300"}) {
    std::string e;
    try {
      from({{"BLU_DIST_TIMEOUT", bad}});
    } catch (const Error& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("BLU_DIST_TIMEOUT: expected a positive number of seconds, got '" + std::string(bad) + "'"),
              std::string::npos)
        << bad << ": " << e;
  }
}

TEST(DistEnv, MpirunAndSlurm) {
  DistEnv e = from({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(e.source, "mpirun");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.local_rank, 1);
  e = from({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  // torchrun's variables win when both are set (torchrun inside a Slurm allocation).
  e = from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "9"}});
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.world_size, 2);
}

void expect_error(const std::map<std::string, std::string>& vars, const std::string& needle) {
  try {
    from(vars);
    FAIL() << "expected an error mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(DistEnv, InconsistentValuesAreClearErrors) {
  expect_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "1"}}, "RANK=4 must be in [0, WORLD_SIZE=4)");
  expect_error({{"RANK", "0"}}, "RANK is set but WORLD_SIZE is not");
  expect_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK: expected an integer, got 'x'");
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"MASTER_PORT", "1"}}, "LOCAL_RANK=2");
  expect_error({{"MASTER_PORT", "70000"}}, "MASTER_PORT must be in [1, 65535], got 70000");
  expect_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, "MASTER_PORT is not set");
  expect_error({{"SLURM_NTASKS", "0"}, {"SLURM_PROCID", "0"}}, "SLURM_NTASKS must be >= 1");
}

}  // namespace
}  // namespace blu::dist
