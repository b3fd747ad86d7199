// What operators read about runs: the status table, the status JSON document (`status
// --json`, the live page's /api/status) and one event as JSON (rdzvd's --event_log, the live
// page's /api/events). The schemas are in docs/operations.md ("Status", "Event log"); they
// only grow (fields are added, never renamed or removed).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "muster/rendezvous/events.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::status {

// "2025-01-02T03:04:05.678Z" (UTC, milliseconds).
std::string iso8601_ms(std::chrono::system_clock::time_point t);

// The status of every run in `reply` as one JSON document (an object, no newline).
std::string status_json(const v1::StatusReply& reply);

// The status as a table for a terminal: a line per run (run id, phase, round,
// restarts/max with those recovered in place, nodes min:max, world size, time in phase),
// under it its members with host and ranks, its waiting nodes, its last failure and its last
// recovery (recovery_line). "no runs" when there is none. Control
// characters in ids are shown as '?'.
std::string status_table(const v1::StatusReply& reply);

// A run's last recovery: "full" (every node restarted its workers), "in_place" (every member
// kept its workers) or "mixed" (some did: a newcomer, a node that could not).
std::string recovery_mode(const v1::RecoveryStatus& r);
// The recovery for a terminal: its round, cause and age, then its phases: noticed (the
// server's restart) -> round formed -> every in-place node resumed, with the slowest node's
// own abort and re-form times.
std::string recovery_line(const v1::RecoveryStatus& r);

// One event as a JSON object (no newline): its name, `wall` as "time" and "unix_ms", and the
// fields that apply to its kind; "seq" first when given (the live page numbers its events).
std::string event_json(const rendezvous::RunEvent& e, std::chrono::system_clock::time_point wall,
                       std::optional<std::uint64_t> seq = std::nullopt);

// When `e` happened on the wall clock, for a caller that gets it from the server's event
// sinks right after the state machine stamped it with the steady clock.
std::chrono::system_clock::time_point wall_time_of(const rendezvous::RunEvent& e);

}  // namespace muster::status
