#include "event_log.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "muster/ops/status_format.h"

namespace muster::rdzvd {

absl::StatusOr<std::unique_ptr<EventLog>> EventLog::open(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("--event_log: empty path");
  if (path == "-") return std::unique_ptr<EventLog>(new EventLog(STDERR_FILENO, false, path));
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--event_log: cannot open '", path, "' for append: ", std::strerror(errno)));
  }
  return std::unique_ptr<EventLog>(new EventLog(fd, true, path));
}

EventLog::~EventLog() {
  if (owned_) ::close(fd_);
}

void EventLog::write(const rendezvous::RunEvent& e) {
  const std::string line = ops::event_json(e, ops::wall_time_of(e)) + "\n";
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!warned_) {
        spdlog::warn("--event_log: cannot write to '{}': {}", path_, std::strerror(errno));
        warned_ = true;
      }
      return;
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace muster::rdzvd
