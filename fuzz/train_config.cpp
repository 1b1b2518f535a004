// Fuzz target: the TOML/INI config file of `blutrain train --config` (CLI11's reader, as
// apps/blutrain/cmd_train.cpp uses it), its items applied to an app with options of each kind.
// CLI11 refuses bad files with CLI::Error, which counts as a clean refusal here too.
#include <CLI/CLI.hpp>
#include <sstream>

#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  std::istringstream in{std::string(blu::fuzz::as_text(data, size))};
  CLI::App app;
  double lr = 0;
  int steps = 0;
  std::string name;
  bool flag = false;
  std::vector<int> list;
  app.add_option("--lr", lr);
  app.add_option("--steps", steps)->check(CLI::Range(1, 1 << 30));
  app.add_option("--name", name);
  app.add_flag("--flag", flag);
  app.add_option("--list", list);
  try {
    CLI::ConfigTOML reader;
    for (const CLI::ConfigItem& item : reader.from_config(in)) {
      if (item.name == "++" || item.name == "--") continue;
      CLI::Option* op = app.get_option_no_throw("--" + item.name);
      if (!op || op->count() > 0) continue;
      if (op->get_expected_min() == 0)
        op->add_result(op->get_flag_value(item.name, reader.to_flag(item)));
      else
        op->add_result(item.inputs);
      op->run_callback();
    }
  } catch (const CLI::Error&) {
  }
})
