// How a test says it did not run, so that ctest reports it Skipped and never Passed.
//
// Two kinds of test binary, two ways:
// - Catch binaries whose cases ctest discovers one by one (catch_discover_tests): a case that
//   cannot run prints one line starting with kSkipMarker and returns; tests/CMakeLists.txt
//   gives every discovered test SKIP_REGULAR_EXPRESSION on that marker. MUSTER_SKIP does both.
// - Standalone binaries (one ctest test each): exit kSkipExit (ctest's SKIP_RETURN_CODE) when
//   nothing can run, and otherwise end with catch_exit(), so that a failure count can never
//   read as a skip (Catch returns the number of failed assertions, and 77 of them is 77).
#pragma once

#include <iostream>
#include <sstream>
#include <string>

namespace muster::testing {

// The exit code of a standalone test binary that could not run (SKIP_RETURN_CODE).
constexpr int kSkipExit = 77;

// The start of the line a skipped Catch case prints: tests/CMakeLists.txt defines it, once, for
// this header and for the SKIP_REGULAR_EXPRESSION it gives the discovered tests.
constexpr const char* kSkipMarker = MUSTER_TEST_SKIP_MARKER;

// Catch::Session().run()'s result as an exit code: 0 when every assertion held, 1 otherwise
// (never kSkipExit, whatever the count of failures).
inline int catch_exit(int failures) { return failures == 0 ? 0 : 1; }

// Prints the skip line (why: what is missing and what installs it). The caller returns.
inline void report_skip(const std::string& why) {
  std::cout << kSkipMarker << " " << why << std::endl;
}

}  // namespace muster::testing

// In a Catch test case: reports the case skipped and returns from it. `why` may be a stream
// expression, as in WARN: MUSTER_SKIP("no " << tool << " here").
#define MUSTER_SKIP(why)                                 \
  do {                                                   \
    std::ostringstream muster_skip_why_;                 \
    muster_skip_why_ << why;                             \
    ::muster::testing::report_skip(muster_skip_why_.str()); \
    return;                                              \
  } while (false)
