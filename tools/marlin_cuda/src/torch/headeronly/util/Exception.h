// mocli shim (not from vLLM or PyTorch): the one macro family vLLM's Marlin sources take from
// <torch/headeronly/util/Exception.h>, so they build without torch. A failed check throws
// std::runtime_error; the extern "C" entry (mocli_marlin.cu) turns it into an error code + message.
#pragma once
#include <sstream>
#include <stdexcept>

namespace mocli_shim {
inline void cat(std::ostringstream&) {}
template <class T, class... R>
void cat(std::ostringstream& o, const T& t, const R&... r) {
  o << t;
  cat(o, r...);
}
template <class... A>
[[noreturn]] void fail(const char* cond, const char* file, int line, const A&... a) {
  std::ostringstream o;
  o << file << ":" << line << ": check failed: " << cond << ": ";
  cat(o, a...);
  throw std::runtime_error(o.str());
}
}  // namespace mocli_shim

#define STD_TORCH_CHECK(cond, ...) \
  do { if (!(cond)) ::mocli_shim::fail(#cond, __FILE__, __LINE__, ##__VA_ARGS__); } while (0)
#define STD_TORCH_CHECK_NOT_IMPLEMENTED STD_TORCH_CHECK
