// dist/env: launcher variables → DistEnv (see env.h for the precedence and the checks).
#include "blu/dist/env.h"

#include <cerrno>
#include <cstdlib>

#include "blu/core/error.h"

namespace blu::dist {

namespace {

// The integer value of variable `name`, or `fallback` when unset. BLU_CHECK on anything else.
long read_int(const std::function<const char*(const char*)>& get, const char* name, long fallback) {
  const char* v = get(name);
  if (!v) return fallback;
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  BLU_CHECK(*v != '\0' && end && *end == '\0' && errno == 0, "environment variable ", name,
            ": expected an integer, got '", v, "'");
  return x;
}

}  // namespace

DistEnv detect_env(const std::function<const char*(const char*)>& get) {
  struct Names {
    const char *source, *rank, *size, *local_rank;
  };
  static const Names kLaunchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  DistEnv env;
  for (const Names& n : kLaunchers) {
    const bool has_rank = get(n.rank) != nullptr, has_size = get(n.size) != nullptr;
    if (!has_rank && !has_size) continue;
    BLU_CHECK(has_rank && has_size, "environment: ", has_rank ? n.rank : n.size, " is set but ",
              has_rank ? n.size : n.rank, " is not (", n.source, " sets both)");
    const long rank = read_int(get, n.rank, 0), size = read_int(get, n.size, 1);
    BLU_CHECK(size >= 1 && size <= 1 << 20, "environment: ", n.size, " must be >= 1, got ", size);
    BLU_CHECK(rank >= 0 && rank < size, "environment: ", n.rank, "=", rank, " must be in [0, ", n.size, "=",
              size, ")");
    const long local = read_int(get, n.local_rank, rank);
    BLU_CHECK(local >= 0 && local <= rank, "environment: ", n.local_rank, "=", local, " must be in [0, ",
              n.rank, "=", rank, "]");
    env.rank = int(rank);
    env.world_size = int(size);
    env.local_rank = int(local);
    env.source = n.source;
    break;
  }
  if (const char* addr = get("MASTER_ADDR")) {
    BLU_CHECK(*addr != '\0', "environment: MASTER_ADDR is set but empty");
    env.master_addr = addr;
  }
  const long port = read_int(get, "MASTER_PORT", env.master_port);
  BLU_CHECK(port >= 1 && port <= 65535, "environment: MASTER_PORT must be in [1, 65535], got ", port);
  env.master_port = int(port);
  if (const char* t = get("BLU_DIST_TIMEOUT")) {
    errno = 0;
    char* end = nullptr;
    const double s = std::strtod(t, &end);
    BLU_CHECK(*t != '\0' && end && *end == '\0' && errno == 0 && s > 0 && s <= 1e9,
              "environment variable BLU_DIST_TIMEOUT: expected a positive number of seconds, got '", t, "'");
    env.dist_timeout_s = s;
  }
  BLU_CHECK(env.world_size == 1 || get("MASTER_PORT") || env.source != "torchrun",
            "environment: WORLD_SIZE=", env.world_size, " but MASTER_PORT is not set (torchrun and ",
            "`blutrain launch` set it)");
  return env;
}

DistEnv detect_env() {
  return detect_env([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace blu::dist
