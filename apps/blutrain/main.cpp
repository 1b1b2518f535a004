// blutrain: the command-line program — info, prepare, train, eval, sample, bench, launch, report, compile, export, import (see docs/cli.md).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "blu/core/crash.h"
#include "blu/core/error.h"
#include "blu/dist/flight_recorder.h"
#include "commands.h"
#include "suggest.h"

int main(int argc, char** argv) {
  // A crash prints its stack (binary + offsets, for addr2line on the unstripped build).
  blu::on_crash_signals([](int sig) { blu::report_crash(sig, "blutrain"); });
  CLI::App app{"blutrain: GPT training with BluTrain", "blutrain"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("blutrain ") + BLU_VERSION);
  const std::vector<blu::cli::Command> commands = {blu::cli::add_info(app), blu::cli::add_prepare(app),
                                                   blu::cli::add_train(app), blu::cli::add_eval(app),
                                                   blu::cli::add_sample(app), blu::cli::add_bench(app),
                                                   blu::cli::add_launch(app), blu::cli::add_report(app),
                                                   blu::cli::add_compile(app), blu::cli::add_export(app),
                                                   blu::cli::add_import(app)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int status = app.exit(e);
    // A flag the command does not know: the nearest one it does, when it looks like a typo.
    if (dynamic_cast<const CLI::ExtrasError*>(&e))
      for (const CLI::App* sub : app.get_subcommands())
        for (const std::string& arg : sub->remaining()) {
          if (arg.rfind("--", 0) != 0) continue;
          const std::string near = blu::cli::closest(arg.substr(2, arg.find('=') - 2), blu::cli::long_options(*sub));
          if (!near.empty()) std::fprintf(stderr, "%s: did you mean --%s?\n", arg.c_str(), near.c_str());
        }
    return status;
  } catch (const std::exception& e) {  // a blu::Error thrown by a validator or callback
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  try {
    for (const auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const std::exception& e) {  // blu::Error and the others alike
    // A check's source location only in the debug mode: the message names flags and files.
    const auto* be = dynamic_cast<const blu::Error*>(&e);
    const char* debug = std::getenv("BLU_DEBUG");
    if (be && !be->where().empty() && debug && *debug && std::string(debug) != "0")
      std::fprintf(stderr, "error: %s [%s]\n", e.what(), be->where().c_str());
    else
      std::fprintf(stderr, "error: %s\n", e.what());
    // A distributed run that failed outside its collectives (a store barrier, a check) still leaves
    // its flight record; a failed collective has written one already.
    auto& fr = blu::dist::FlightRecorder::global();
    if (!fr.dumped()) fr.dump(std::string("fatal error: ") + e.what());
    return 1;
  }
  return 0;
}
