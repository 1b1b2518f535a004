// train/report_page: the run report's HTML, CSS and script (train/report.h builds the data).
// Depends on nlohmann-json and train/report's ReportAssets. Keep: the data goes in as a JSON
// blob that the script parses (every '<' escaped, invalid UTF-8 replaced), the page's only code is
// inline, and its Content-Security-Policy refuses every network load.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "blu/train/report.h"

namespace blu::train {

// `data`: {"title", "plots": report_plots(...), "runs": [{"name", "dir", "color", "config",
// "summary", "samples": [{"step", "text"}], "events"}]}.
std::string report_page_html(const nlohmann::json& data, const ReportAssets& assets);

}  // namespace blu::train
