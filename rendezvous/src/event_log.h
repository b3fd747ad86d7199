// rdzvd --event_log: one JSON object per line for every run event (events.h), in the schema
// of docs/operations.md ("Event log").
//
// Threads: write() is an event sink of the server, called on its io thread only.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "muster/rendezvous/events.h"

namespace muster::rdzvd {

class EventLog {
 public:
  // "-" is stderr; anything else is a file opened for append (created 0644 if missing), so
  // that a restarted daemon adds to what its predecessor wrote. Fails naming the path.
  static absl::StatusOr<std::unique_ptr<EventLog>> open(const std::string& path);
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  // One line, written with one write(2) to an O_APPEND file: lines of several writers to one
  // file do not interleave. A failed write is logged once (spdlog) and the daemon goes on.
  void write(const rendezvous::RunEvent& e);

 private:
  EventLog(int fd, bool owned, std::string path) : fd_(fd), owned_(owned), path_(std::move(path)) {}
  int fd_;
  bool owned_;
  std::string path_;
  bool warned_ = false;
};

}  // namespace muster::rdzvd
