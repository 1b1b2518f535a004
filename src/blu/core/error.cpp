#include "blu/core/error.h"

#include <cstring>

namespace blu::detail {

static const char* basename_of(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

void throw_check(const char* file, int line, const char* cond, const std::string& msg) {
  // The message is what the user acts on; the location, kept apart, helps bug reports.
  throw Error(msg.empty() ? std::string("check failed: ") + cond : msg, concat(basename_of(file), ":", line));
}

void throw_assert(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(concat("internal error (a BluTrain bug): ", cond, " is false at ", basename_of(file), ":",
                             line, msg.empty() ? "" : ": ", msg));
}

}  // namespace blu::detail
