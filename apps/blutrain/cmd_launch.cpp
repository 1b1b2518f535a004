// `blutrain launch -n N -- command...`: N local ranks of a distributed job (dist/launch.h).
#include <memory>
#include <string>
#include <vector>

#include "blu/core/error.h"
#include "blu/dist/launch.h"
#include "commands.h"

namespace blu::cli {

Command add_launch(CLI::App& root) {
  auto o = std::make_shared<dist::LaunchOptions>();
  auto grace_s = std::make_shared<double>(5.0);
  CLI::App* app = root.add_subcommand(
      "launch", "Run N local copies of a command as ranks of one job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                "MASTER_PORT set); output lines are prefixed with [rank k]; when one rank fails the others are stopped");
  app->add_option("-n,--nproc", o->nproc, "number of processes (ranks)")->required()->check(CLI::Range(1, 1024));
  app->add_option("--master-port", o->master_port, "rendezvous port (default: a free one)")->check(CLI::Range(0, 65535));
  app->add_option("--grace", *grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::Range(0.0, 3600.0));
  app->add_option("--max-restarts", o->max_restarts,
                  "start the whole job again after a rank fails, up to N times (BLU_RESTART_COUNT tells the ranks; "
                  "pair with `blutrain train --auto-resume`)")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  app->add_option("command", o->command, "the command each rank runs (after --)")->required();
  app->positionals_at_end();
  return {app, [o, grace_s] {
            o->grace = std::chrono::milliseconds(int64_t(*grace_s * 1000));
            return dist::launch(*o);
          }};
}

}  // namespace blu::cli
