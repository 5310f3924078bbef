// Helpers shared by the C++ tests: deterministic random tensors, tolerant comparison, status matchers.
#ifndef MHA_TESTS_TEST_UTIL_H_
#define MHA_TESTS_TEST_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace mha::testing {

// A TCP socket listening on 127.0.0.1 at a free port, of socket type SOCK_STREAM | `type_flags` (e.g.
// SOCK_NONBLOCK), with its address in *address; -1 if it cannot be made. The caller closes it.
inline int ListenOnLoopback(int type_flags, sockaddr_in* address) {
  const int fd = socket(AF_INET, SOCK_STREAM | type_flags, 0);
  if (fd < 0) return -1;
  *address = sockaddr_in{};
  address->sin_family = AF_INET;
  address->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(*address);
  if (bind(fd, reinterpret_cast<sockaddr*>(address), sizeof(*address)) != 0 || listen(fd, 16) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(address), &length) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// n values uniform in [-bound, bound] from `seed`.
inline std::vector<float> RandomVector(int64_t n, uint32_t seed, float bound = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-bound, bound);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(rng);
  return v;
}

// Checks |got - want| <= atol + rtol * |want| elementwise and that got is NaN exactly where want is (where a NaN
// input propagates); reports the worst element. A buffer both sides leave NaN-filled passes: check want with NaNCount.
// How many elements of x are NaN.
inline int64_t NaNCount(const std::vector<float>& x) {
  int64_t n = 0;
  for (float v : x) n += std::isnan(v) ? 1 : 0;
  return n;
}

inline ::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& want,
                                           double atol, double rtol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << want.size();
  }
  double worst = 0.0;
  int64_t worst_index = -1, bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) {
      return ::testing::AssertionFailure() << "NaN mismatch at " << i << ": got " << got[i] << " want " << want[i];
    }
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    const double allowed = atol + rtol * std::abs(static_cast<double>(want[i]));
    if (err > allowed) ++bad;
    if (err - allowed > worst || (worst_index < 0 && err > allowed)) {
      worst = err - allowed;
      worst_index = static_cast<int64_t>(i);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ; worst at "
                                       << worst_index << ": got " << got[worst_index] << " want "
                                       << want[worst_index] << " (atol " << atol << ", rtol " << rtol << ")";
}

}  // namespace mha::testing

#define EXPECT_OK(expr)                                      \
  do {                                                       \
    const ::absl::Status mha_test_status_ = (expr);          \
    EXPECT_TRUE(mha_test_status_.ok()) << mha_test_status_;  \
  } while (0)
#define ASSERT_OK(expr)                                      \
  do {                                                       \
    const ::absl::Status mha_test_status_ = (expr);          \
    ASSERT_TRUE(mha_test_status_.ok()) << mha_test_status_;  \
  } while (0)

#endif  // MHA_TESTS_TEST_UTIL_H_
