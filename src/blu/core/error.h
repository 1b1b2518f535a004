// core/error: the two tiers of error reporting.
//   BLU_CHECK(cond, ...)  — the caller's mistake (bad shape, dtype, index, file). Throws blu::Error
//                           whose message says what was expected and what was given (the source
//                           location travels apart from it: Error::where()).
//   BLU_ASSERT(cond, ...) — our own invariant. Throws blu::InternalError; seeing one is a bug.
// Depends on nothing but the standard library. The message arguments are streamed with <<, so
// shapes, dtypes and devices print themselves.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <cstdint>

namespace blu {

// what() is the message for the user; where() the BLU_CHECK's "file.cpp:line" (empty for an Error
// made elsewhere), which the command line prints only in its debug mode (BLU_DEBUG=1).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
  Error(const std::string& message, std::string where) : std::runtime_error(message), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};
struct InternalError : std::logic_error {
  using std::logic_error::logic_error;
};

namespace detail {
template <typename T>
void put(std::ostream& os, const T& v) {
  os << v;
}
// Shapes and other integer lists print as [a, b, c].
inline void put(std::ostream& os, const std::vector<int64_t>& v) {
  os << '[';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << ']';
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (put(os, args), ...);
  return os.str();
}
[[noreturn]] void throw_check(const char* file, int line, const char* cond, const std::string& msg);
[[noreturn]] void throw_assert(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace blu

#define BLU_CHECK(cond, ...)                                                                    \
  do {                                                                                          \
    if (!(cond)) [[unlikely]]                                                                   \
      ::blu::detail::throw_check(__FILE__, __LINE__, #cond, ::blu::detail::concat(__VA_ARGS__)); \
  } while (0)

#define BLU_ASSERT(cond, ...)                                                                    \
  do {                                                                                           \
    if (!(cond)) [[unlikely]]                                                                    \
      ::blu::detail::throw_assert(__FILE__, __LINE__, #cond, ::blu::detail::concat(__VA_ARGS__)); \
  } while (0)

#ifdef NDEBUG
#define BLU_DEBUG_ASSERT(cond, ...) ((void)0)
#else
#define BLU_DEBUG_ASSERT(cond, ...) BLU_ASSERT(cond, __VA_ARGS__)
#endif

#define BLU_CONCAT_INNER(a, b) a##b
#define BLU_CONCAT(a, b) BLU_CONCAT_INNER(a, b)
