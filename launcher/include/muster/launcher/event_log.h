// launch --event_log FILE: one JSON object per line for every event of this node
// (agent_events.h), with a recovery's timings per phase (docs/operations.md, "Event log").
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "muster/agent/agent_events.h"

namespace muster::launcher {

// Who wrote the line: the same on every line of one launch.
struct EventLogSource {
  std::string run_id;
  std::string node_id;
  std::string host;
};

class AgentEventLog {
 public:
  // Opens `path` for appending ("-": stderr). Each line is written whole, unbuffered, so a
  // kill -9 loses no line already logged and several launches may share one file.
  static absl::StatusOr<std::unique_ptr<AgentEventLog>> open(const std::string& path,
                                                             EventLogSource source);
  ~AgentEventLog();
  AgentEventLog(const AgentEventLog&) = delete;
  AgentEventLog& operator=(const AgentEventLog&) = delete;

  void write(const agent::AgentEvent& e);

 private:
  AgentEventLog(int fd, bool owned, EventLogSource source);
  int fd_;
  bool owned_;
  EventLogSource source_;
};

// The line write() writes, without its newline (for tests).
std::string event_log_line(const agent::AgentEvent& e, const EventLogSource& source);

}  // namespace muster::launcher
