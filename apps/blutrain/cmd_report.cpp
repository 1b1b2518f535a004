// `blutrain report`: one self-contained HTML page of one or more runs (train/report.h), and on
// request TensorBoard event files of the same series (train/tb_events.h).
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/error.h"
#include "blu/io/json_file.h"
#include "blu/train/report.h"
#include "blu/train/tb_events.h"
#include "commands.h"

namespace blu::cli {

namespace {

namespace fs = std::filesystem;

struct ReportArgs {
  std::vector<std::string> run_dirs;
  std::string out = "report.html", tensorboard;
};

int run_report(const ReportArgs& a) {
  const fs::path out = a.out;
  BLU_CHECK(!fs::is_directory(out), "-o/--out must name the page's file, got the folder '", a.out, "'");
  const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  BLU_CHECK(fs::is_directory(parent), "-o/--out: the folder '", parent.string(), "' of '", a.out,
            "' does not exist");
  std::vector<fs::path> dirs(a.run_dirs.begin(), a.run_dirs.end());
  const std::vector<train::RunData> runs = train::read_runs(dirs);
  for (const auto& r : runs)
    for (const auto& w : r.warnings) std::cerr << "warning: " << w << "\n";
  const train::ReportAssets assets = train::load_report_assets();
  io::write_file_atomic(out, train::render_report(runs, assets));
  std::cout << "wrote " << out.string() << " (" << runs.size() << (runs.size() == 1 ? " run" : " runs") << ")\n";
  if (!a.tensorboard.empty())
    for (const auto& f : train::write_tensorboard(runs, a.tensorboard)) std::cout << "wrote " << f.string() << "\n";
  return 0;
}

}  // namespace

Command add_report(CLI::App& root) {
  auto a = std::make_shared<ReportArgs>();
  CLI::App* app = root.add_subcommand("report", "An HTML page of runs' metrics, samples and config (offline)");
  app->add_option("run_dirs", a->run_dirs, "Run folders (the --out of `blutrain train`); several are overlaid")
      ->required();
  app->add_option("-o,--out", a->out, "The HTML file to write (replaced atomically if it exists)")
      ->capture_default_str();
  app->add_option("--tensorboard", a->tensorboard,
                  "Also write TensorBoard event files, one folder per run, under this folder");
  return {app, [a] { return run_report(*a); }};
}

}  // namespace blu::cli
