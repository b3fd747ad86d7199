// A file of JSON lines that several writers may share (the event logs of rdzvd and launch):
// opened for append, one write(2) per line, so lines are whole and never interleave, and a
// kill -9 loses no line already written.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace muster::ops {

class JsonLinesFile {
 public:
  // "-" is stderr; anything else is opened for append (created 0644 if missing). Fails with
  // "<flag>: cannot open '<path>' for append: <why>".
  static absl::StatusOr<std::unique_ptr<JsonLinesFile>> open(const std::string& path,
                                                             std::string_view flag);
  ~JsonLinesFile();
  JsonLinesFile(const JsonLinesFile&) = delete;
  JsonLinesFile& operator=(const JsonLinesFile&) = delete;

  // Writes `json` and a newline. A failed write is logged once (spdlog) and the caller goes
  // on: a full disk must not stop a job.
  void write_line(std::string_view json);

 private:
  JsonLinesFile(int fd, bool owned, std::string path)
      : fd_(fd), owned_(owned), path_(std::move(path)) {}
  int fd_;
  bool owned_;
  std::string path_;
  bool warned_ = false;
};

}  // namespace muster::ops
