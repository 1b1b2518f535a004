// io/json_file: JSON files the framework reads and writes beside its tensors — run.json,
// config.json, a sharded checkpoint's index — and the atomic write they share.
// Depends on nlohmann-json, core/error. Keep: a failed write leaves the previous file as it was
// (temporary file in the same folder, fsync, rename, fsync of the folder); every failing call
// (write, fsync, close, rename, the folder's fsync) is an error naming the file, never ignored.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

namespace blu::io {

// The JSON value in `path`; BLU_CHECK "<path>: cannot open" / "<path>: empty file" / "<path>: not
// valid JSON: …".
nlohmann::json read_json_file(const std::filesystem::path& path);
// Writes `text` to `path` atomically (see the header comment; Note [Write fault injection] in the
// .cpp for the tests' way to make it fail). `shared`: other processes may write the same path at
// the same time (ranks filling one kernel cache), so the temporary is this process's own
// (`<path>.tmp<pid>`) instead of `<path>.tmp`.
void write_file_atomic(const std::filesystem::path& path, const std::string& text, bool shared = false);
// j.dump(2) and a newline, atomically.
void write_json_file(const std::filesystem::path& path, const nlohmann::json& j);

}  // namespace blu::io
