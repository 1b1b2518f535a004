// dist/env: where this process sits in a distributed job — rank, world size, local rank and the
// rendezvous address (MASTER_ADDR:MASTER_PORT) — read from the environment of whichever launcher
// started it: `blutrain launch` and torchrun (RANK, WORLD_SIZE, LOCAL_RANK), mpirun (Open MPI's
// OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK) or Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
// A process started by none of them is rank 0 of 1.
// Depends on core/error. Keep: the torchrun variables win over mpirun's, which win over Slurm's
// (torchrun under Slurm sets both); values are checked (integers, 0 <= rank < world_size,
// 0 <= local_rank <= rank, port in 1..65535, BLU_DIST_TIMEOUT a positive number) and a bad one is a BLU_CHECK error naming the variable.
#pragma once
#include <functional>
#include <string>

namespace blu::dist {

struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "none";  // "torchrun", "mpirun", "slurm" or "none"
  // BLU_DIST_TIMEOUT: seconds after which the store, Gloo and NCCL give up waiting; 0 when unset
  // (each keeps its own default).
  double dist_timeout_s = 0;
  bool is_distributed() const { return world_size > 1; }
};

// Reads the process environment.
DistEnv detect_env();
// Reads through `get` (returns nullptr for an unset name): for tests.
DistEnv detect_env(const std::function<const char*(const char*)>& get);

}  // namespace blu::dist
