#include "blu/io/json_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "blu/core/error.h"

namespace blu::io {

namespace fs = std::filesystem;

nlohmann::json read_json_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  BLU_CHECK(in.good(), path.string(), ": cannot open");
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  BLU_CHECK(!in.bad(), path.string(), ": cannot read");
  BLU_CHECK(!text.empty(), path.string(), ": empty file (expected JSON; a write was cut short?)");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, path.string(), ": not valid JSON: ", e.what());
  }
  return {};
}

void write_file_atomic(const fs::path& path, const std::string& text, bool shared) {
  const fs::path tmp = path.string() + ".tmp" + (shared ? std::to_string(::getpid()) : "");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BLU_CHECK(fd >= 0, "cannot create ", tmp.string(), ": ", std::strerror(errno));
  // Note [Write fault injection]: BLU_TEST_WRITE_FULL=<file name> sends this file's bytes to
  // /dev/full, so tests see the failure a full disk gives (ENOSPC) on exactly that file.
  int out = fd;
  if (const char* full = std::getenv("BLU_TEST_WRITE_FULL"); full && path.filename() == full)
    out = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  const auto fail = [&](const char* what, int err) {
    if (out != fd && out >= 0) ::close(out);
    ::close(fd);
    ::unlink(tmp.c_str());
    BLU_CHECK(false, "cannot ", what, " ", tmp.string(), " (for ", path.string(), "): ", std::strerror(err));
  };
  if (out < 0) fail("write", errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(out, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write", n < 0 ? errno : EIO);
    done += size_t(n);
  }
  if (::fsync(out) != 0) fail("fsync", errno);
  if (out != fd) ::close(out);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    BLU_CHECK(false, "cannot close ", tmp.string(), " (for ", path.string(), "): ", std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    BLU_CHECK(false, "cannot rename ", tmp.string(), " to ", path.string(), ": ", std::strerror(err));
  }
  // The rename is durable once the folder is synced.
  const std::string dir = path.parent_path().empty() ? std::string(".") : path.parent_path().string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  BLU_CHECK(dfd >= 0, "cannot open the folder ", dir, " to fsync ", path.string(), ": ", std::strerror(errno));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  BLU_CHECK(rc == 0, "cannot fsync the folder ", dir, " after writing ", path.string(), ": ", std::strerror(err));
}

void write_json_file(const fs::path& path, const nlohmann::json& j) { write_file_atomic(path, j.dump(2) + "\n"); }

}  // namespace blu::io
