#include "muster/ops/json_lines.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace muster::ops {

absl::StatusOr<std::unique_ptr<JsonLinesFile>> JsonLinesFile::open(const std::string& path,
                                                                   std::string_view flag) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(std::string(flag), ": empty path"));
  if (path == "-") {
    return std::unique_ptr<JsonLinesFile>(new JsonLinesFile(STDERR_FILENO, false, path));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(flag), ": cannot open '", path, "' for append: ", std::strerror(errno)));
  }
  return std::unique_ptr<JsonLinesFile>(new JsonLinesFile(fd, true, path));
}

JsonLinesFile::~JsonLinesFile() {
  if (owned_) ::close(fd_);
}

void JsonLinesFile::write_line(std::string_view json) {
  const std::string line = std::string(json) + "\n";  // one write(2): whole under O_APPEND
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!warned_) {
        spdlog::warn("event log: cannot write to '{}': {}", path_, std::strerror(errno));
        warned_ = true;
      }
      return;
    }
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace muster::ops
