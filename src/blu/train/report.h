// train/report: the run report — one self-contained HTML page that plots what runs recorded in
// their folders (metrics.jsonl: train and validation loss, learning rate, gradient norm, tok/s,
// MFU, memory; run.json: the config; the samples over time), one colour per run, several runs
// overlaid. `blutrain report` is its command-line face.
//   read_run        a run folder → its events and config; refuses a folder without metrics.jsonl
//                   and names the file and line of a malformed JSONL line.
//   report_plots    the runs' events → the plots' series (x = step), as JSON. The page draws
//                   exactly these; the browser test checks the drawn series against the JSONL.
//   render_report   the page: uPlot's JS and CSS (scripts/fetch_uplot.sh vendors them) and the
//                   runs' data inlined, a Content-Security-Policy that allows no network load.
//                   After drawing, the page's script records each plot's series and point counts
//                   in the DOM (the plot's data-series attribute, document.body's
//                   data-report-status) for tests to read.
// Depends on nlohmann-json, io/json_file (the atomic write). Keep: the page loads nothing from the
// network and is written atomically (a reader sees the old page or the new one, never half);
// run data reaches the page only as JSON parsed by the script, never as markup.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace blu::train {

struct RunData {
  std::string name;               // the run's label in legends and tables
  std::filesystem::path dir;
  nlohmann::json config;          // run.json's contents; null when the folder has none
  std::vector<nlohmann::json> events;  // metrics.jsonl's objects, in file order
  std::vector<std::string> warnings;   // what was skipped while reading, for the user
};

// Reads <dir>/metrics.jsonl and <dir>/run.json. Every line must be a JSON object with a string
// "event"; otherwise BLU_CHECK names "<file>:<line>". A last line without its newline that does
// not parse is half of a line a running or killed run was writing: skipped, with a warning.
RunData read_run(const std::filesystem::path& dir);
// read_run for each folder; runs whose folder names coincide are labelled by the paths given.
std::vector<RunData> read_runs(const std::vector<std::filesystem::path>& dirs);

// What the report plots. Each plot: {"id", "title", "unit", "series": [{"run", "label", "part",
// "color", "dash", "x": [steps], "y": [values]}]} ("part": "train", "val", "bigram_baseline", or
// "" for a plot's only series). Ids, and the series each run contributes when it
// recorded the value (a step or eval event holding a number under the key):
//   loss       "<run> train" (step: loss), "<run> val" (eval: val_loss),
//              "<run> bigram baseline" (eval: bigram_loss)
//   lr         step: lr          grad_norm  step: norm       tok_per_s  step: tok_per_s
//   mfu        step: mfu (a fraction, plotted in %)          memory     step: mem_bytes (MiB)
// A plot no run recorded keeps its place with no series. A step repeated within one series keeps
// its last value.
nlohmann::json report_plots(const std::vector<RunData>& runs);

// uPlot's files as the page inlines them.
struct ReportAssets {
  std::string uplot_js, uplot_css, uplot_license;
};
// $BLU_UPLOT_DIR when set, else <source dir>/.deps/uplot/node_modules/uplot.
std::filesystem::path default_uplot_dir();
// Reads dist/uPlot.iife.min.js, dist/uPlot.min.css and LICENSE under `dir`; BLU_CHECK says to run
// scripts/fetch_uplot.sh when they are missing.
ReportAssets load_report_assets(const std::filesystem::path& dir = default_uplot_dir());

// The HTML page for `runs` (at least one).
std::string render_report(const std::vector<RunData>& runs, const ReportAssets& assets);

}  // namespace blu::train
