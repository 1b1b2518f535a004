// apps/blutrain/commands: how the subcommands plug into main. Each cmd_<name>.cpp adds its
// subcommand to the root app and returns the function that runs it once parsing is done.
// Depends on CLI11 and the blu library. Keep: parsing never touches the disk; a command returns
// the process exit status and reports user errors by throwing blu::Error (main prints them).
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace blu::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Command add_info(CLI::App& root);
Command add_prepare(CLI::App& root);
Command add_train(CLI::App& root);
Command add_eval(CLI::App& root);
Command add_sample(CLI::App& root);
Command add_bench(CLI::App& root);
Command add_launch(CLI::App& root);
Command add_report(CLI::App& root);
Command add_compile(CLI::App& root);
Command add_export(CLI::App& root);
Command add_import(CLI::App& root);

}  // namespace blu::cli
