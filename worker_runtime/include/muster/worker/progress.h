// The worker's side of the progress page (progress_page.h): maps the page the agent made and
// named in MUSTER_PROGRESS_FILE, and writes the step and phase to it. Runtime holds one
// (Runtime::progress); a program without a Runtime may make its own.
//
// Never an error: without the variable (under torchrun, or an agent that does not watch for
// hangs) or when the page cannot be used, every report() is a no-op. A page that is named but
// unusable (missing, short, wrong magic or version) gets one warning line on stderr.
//
// Thread safety: the page has one writer (a sequence lock, not a mutex): call report() from one
// thread at a time, normally the training loop's.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "muster/ops/progress_page.h"

namespace muster::worker {

class ProgressReporter {
 public:
  ProgressReporter() = default;  // reports nowhere
  // Maps the page at `path` (open, check size, magic and version, mmap MAP_SHARED, close the
  // fd). An empty `path`: a silent no-op reporter.
  explicit ProgressReporter(const std::string& path);
  // The page named by kProgressFileVar in `env`, if any.
  static ProgressReporter from_env(const std::map<std::string, std::string>& env);
  ~ProgressReporter();
  ProgressReporter(ProgressReporter&& other) noexcept;
  ProgressReporter& operator=(ProgressReporter&& other) noexcept;
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // True when reports reach a page.
  bool active() const { return page_ != nullptr; }

  // Records `step` (a negative step is recorded as 0) and `phase` (cut to 63 bytes) with the
  // CLOCK_MONOTONIC time. A few stores and a vDSO clock read: no system call, no lock.
  void report(std::int64_t step, std::string_view phase = "") {
    if (page_ != nullptr) {
      write_progress(page_, step < 0 ? 0 : static_cast<std::uint64_t>(step), phase);
    }
  }

  // Only the phase (progress_page.h, write_phase): for what some ranks do and others do not.
  void phase(std::string_view phase) {
    if (page_ != nullptr) write_phase(page_, phase);
  }

 private:
  ProgressPage* page_ = nullptr;
};

}  // namespace muster::worker
