#include "muster/status/status_format.h"

#include <time.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/ops/json.h"

namespace muster::status {

using namespace muster::ops;
namespace {

using Kind = rendezvous::RunEvent::Kind;

std::int64_t unix_ms(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}

// "850ms", "12.3s", "5m02s", "3h07m".
std::string human_duration(std::int64_t ms) {
  if (ms < 1000) return absl::StrCat(ms, "ms");
  char buf[32];
  if (ms < 60'000) {
    std::snprintf(buf, sizeof buf, "%.1fs", static_cast<double>(ms) / 1000);
  } else if (ms < 3'600'000) {
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(ms / 60'000),
                  static_cast<long long>(ms / 1000 % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(ms / 3'600'000),
                  static_cast<long long>(ms / 60'000 % 60));
  }
  return buf;
}

// Text from a client (ids, hosts, reasons) as a terminal may show it.
std::string printable(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) c = '?';
  }
  return out;
}

std::string ranks_of(const v1::NodeStatus& n) {
  if (n.local_world_size() <= 1) return absl::StrCat(n.first_rank());
  return absl::StrCat(n.first_rank(), "-", n.first_rank() + n.local_world_size() - 1);
}

std::string how_it_ended(const v1::FailureStatus& f) {
  return f.signal() > 0 ? absl::StrCat("signal ", f.signal())
                        : absl::StrCat("exit code ", f.exit_code());
}

// Rows of cells, each column as wide as its widest cell (the last one is not padded).
void append_columns(std::string& out, const std::vector<std::vector<std::string>>& rows,
                    const std::string& indent) {
  std::vector<std::size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (std::size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line = indent;
    for (std::size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line.append(width[i] - row[i].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  }
}

std::string failure_json(const v1::FailureStatus& f) {
  JsonObject j;
  j.add("round", f.round())
      .add("rank", f.rank())
      .add("host", f.host())
      .add("node_id", f.node_id())
      .add("exit_code", f.exit_code())
      .add("signal", f.signal());
  if (f.timestamp_ms() > 0) {
    j.add("time", iso8601_ms(std::chrono::system_clock::time_point(
                      std::chrono::milliseconds(f.timestamp_ms()))))
        .add("unix_ms", static_cast<long long>(f.timestamp_ms()));
  }
  j.add("age_ms", static_cast<long long>(f.age_ms())).add("reason", f.reason());
  return j.str();
}

std::string recovery_json(const v1::RecoveryStatus& r) {
  return JsonObject()
      .add("round", r.round())
      .add("cause", r.cause())
      .add("mode", recovery_mode(r))
      .add("nodes", r.nodes())
      .add("nodes_in_place", r.nodes_in_place())
      .add("nodes_resumed", r.nodes_resumed())
      .add("formed_ms", static_cast<long long>(r.formed_ms()))
      .add("resumed_ms", static_cast<long long>(r.resumed_ms()))
      .add("abort_ms", static_cast<long long>(r.abort_ms()))
      .add("reform_ms", static_cast<long long>(r.reform_ms()))
      .add("age_ms", static_cast<long long>(r.age_ms()))
      .str();
}

}  // namespace

std::string recovery_mode(const v1::RecoveryStatus& r) {
  if (r.nodes_in_place() == 0) return "full";
  if (r.nodes_in_place() < r.nodes()) return "mixed";
  return "in_place";
}

std::string recovery_line(const v1::RecoveryStatus& r) {
  std::string out = absl::StrCat("round ", r.round(), " after a restart (", printable(r.cause()),
                                 "), ", human_duration(r.age_ms()), " ago: ");
  if (r.nodes_in_place() == 0) {
    absl::StrAppend(&out, "full restart, every worker new; round formed ",
                    human_duration(r.formed_ms()), " after the restart");
    return out;
  }
  absl::StrAppend(&out, "in place on ", r.nodes_in_place(), " of ", r.nodes(),
                  " node(s); noticed -> round formed ", human_duration(r.formed_ms()));
  if (r.nodes_resumed() == r.nodes_in_place()) {
    absl::StrAppend(&out, " -> resumed ", human_duration(r.resumed_ms()));
  } else {
    absl::StrAppend(&out, " -> ", r.nodes_resumed(), " of ", r.nodes_in_place(),
                    " node(s) resumed so far");
  }
  if (r.nodes_resumed() > 0) {
    absl::StrAppend(&out, " (slowest node: abort ", human_duration(r.abort_ms()), ", re-form ",
                    human_duration(r.reform_ms()), ")");
  }
  return out;
}

std::string iso8601_ms(std::chrono::system_clock::time_point t) {
  const std::int64_t ms = unix_ms(t);
  // Floor division, so that times before 1970 keep a positive millisecond part.
  std::int64_t secs = ms / 1000, rem = ms % 1000;
  if (rem < 0) {
    rem += 1000;
    secs -= 1;
  }
  const time_t tt = static_cast<time_t>(secs);
  struct tm tm {};
  ::gmtime_r(&tt, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(rem));
  return buf;
}

std::chrono::system_clock::time_point wall_time_of(const rendezvous::RunEvent& e) {
  const auto since = std::chrono::steady_clock::now() - e.at;
  return std::chrono::system_clock::now() -
         std::chrono::duration_cast<std::chrono::system_clock::duration>(since);
}

std::string status_json(const v1::StatusReply& reply) {
  std::vector<std::string> runs;
  for (const v1::RunStatus& r : reply.runs()) {
    JsonObject j;
    j.add("run_id", r.run_id()).add("phase", r.phase());
    if (!r.result().empty()) j.add("result", r.result());
    j.add("round", r.round())
        .add("phase_age_ms", static_cast<long long>(r.phase_age_ms()))
        .add("restart_count", r.restart_count())
        .add("max_restarts", r.max_restarts())
        .add("min_nodes", r.min_nodes())
        .add("max_nodes", r.max_nodes())
        .add("world_size", r.world_size());
    std::vector<std::string> members, waiting;
    for (const v1::NodeStatus& n : r.member_nodes()) {
      members.push_back(JsonObject()
                            .add("node_id", n.node_id())
                            .add("host", n.host())
                            .add("group_rank", n.group_rank())
                            .add("local_world_size", n.local_world_size())
                            .add("first_rank", n.first_rank())
                            .add("last_rank", n.first_rank() + n.local_world_size() - 1)
                            .str());
    }
    for (const v1::NodeStatus& n : r.waiting_nodes()) {
      waiting.push_back(JsonObject()
                            .add("node_id", n.node_id())
                            .add("host", n.host())
                            .add("local_world_size", n.local_world_size())
                            .str());
    }
    j.add_raw("members", json_array(members)).add_raw("waiting", json_array(waiting));
    j.add_raw("last_failure", r.has_last_failure() ? failure_json(r.last_failure()) : "null");
    j.add("in_place_recoveries", r.in_place_recoveries())
        .add("in_place_fallbacks", r.in_place_fallbacks())
        .add_raw("last_recovery",
                 r.has_last_recovery() ? recovery_json(r.last_recovery()) : "null");
    if (r.watching_stragglers()) {  // docs/stragglers.md
      std::vector<std::string> named;
      for (const v1::StragglerStatus& s : r.stragglers()) {
        named.push_back(JsonObject()
                            .add("rank", s.rank())
                            .add("host", s.host())
                            .add("node_id", s.node_id())
                            .add("cause", s.cause())
                            .add("slowdown", s.slowdown())
                            .add("step", static_cast<long long>(s.step()))
                            .add("age_ms", static_cast<long long>(s.age_ms()))
                            .add("kept", s.kept())
                            .str());
      }
      j.add_raw("stragglers", json_array(named));
    }
    if (r.excluding_stragglers()) {  // docs/stragglers.md, "Exclusion"
      std::vector<std::string> out;
      for (const v1::ExcludedStatus& x : r.excluded()) {
        out.push_back(JsonObject()
                          .add("node_id", x.node_id())
                          .add("host", x.host())
                          .add("times", x.times())
                          .add("cooldown_ms", static_cast<long long>(x.cooldown_ms()))
                          .add("left_ms", static_cast<long long>(x.left_ms()))
                          .add("slowdown", x.slowdown())
                          .add("cause", x.cause())
                          .str());
      }
      j.add("excluding_stragglers", true).add_raw("excluded", json_array(out));
    }
    runs.push_back(j.str());
  }
  const auto parked = static_cast<long long>(reply.store().parked_waits());
  JsonObject doc;
  doc.add_raw("runs", json_array(runs))
      .add_raw("store", JsonObject().add("parked_waits", parked).str());
  // The answering server's build; a server older than the field sends none.
  if (!reply.server_version().empty()) {
    doc.add_raw("server", JsonObject()
                              .add("version", reply.server_version())
                              .add("commit", reply.server_commit())
                              .str());
  }
  return doc.str();
}

std::string status_table(const v1::StatusReply& reply) {
  if (reply.runs().empty()) return "no runs\n";
  std::string out;
  for (const v1::RunStatus& r : reply.runs()) {
    if (!out.empty()) out += '\n';
    std::string phase = r.phase();
    if (!r.result().empty()) absl::StrAppend(&phase, " (", r.result(), ")");
    std::string restarts = absl::StrCat(r.restart_count(), "/", r.max_restarts());
    if (r.in_place_recoveries() > 0 || r.in_place_fallbacks() > 0) {
      absl::StrAppend(&restarts, " (", r.in_place_recoveries(), " in place");
      if (r.in_place_fallbacks() > 0)
        absl::StrAppend(&restarts, ", ", r.in_place_fallbacks(), " fell back");
      restarts += ')';
    }
    append_columns(out,
                   {{"RUN", "PHASE", "ROUND", "RESTARTS", "NODES", "WORLD", "IN PHASE"},
                    {printable(r.run_id()), phase, absl::StrCat(r.round()), restarts,
                     absl::StrCat(r.min_nodes(), ":", r.max_nodes()), absl::StrCat(r.world_size()),
                     human_duration(r.phase_age_ms())}},
                   "");
    std::vector<std::vector<std::string>> nodes;
    if (r.member_nodes_size() > 0 || r.waiting_nodes_size() > 0) {
      nodes.push_back({"STATE", "GROUP", "RANKS", "HOST", "NODE"});
    }
    for (const v1::NodeStatus& n : r.member_nodes()) {
      nodes.push_back({"member", absl::StrCat(n.group_rank()), ranks_of(n), printable(n.host()),
                       printable(n.node_id())});
    }
    for (const v1::NodeStatus& n : r.waiting_nodes()) {
      nodes.push_back({"waiting", "-", absl::StrCat("(", n.local_world_size(), ")"),
                       printable(n.host()), printable(n.node_id())});
    }
    append_columns(out, nodes, "  ");
    if (r.has_last_failure()) {
      const v1::FailureStatus& f = r.last_failure();
      absl::StrAppend(&out, "  last failure: rank ", f.rank(), " on ", printable(f.host()), ", ",
                      how_it_ended(f), ", round ", f.round(), ", ", human_duration(f.age_ms()),
                      " ago: ", printable(f.reason()), "\n");
    }
    if (r.has_last_recovery()) {
      absl::StrAppend(&out, "  last recovery: ", recovery_line(r.last_recovery()), "\n");
    }
    for (const v1::StragglerStatus& s : r.stragglers()) {
      absl::StrAppend(&out, "  straggler: rank ", s.rank(), " on ", printable(s.host()), ", ",
                      absl::StrFormat("%.1fx", s.slowdown()), " the others' own work per step (",
                      printable(s.cause()), "), named at step ", s.step(), ", ",
                      human_duration(s.age_ms()), " ago",
                      s.kept().empty() ? "" : absl::StrCat("; kept: ", printable(s.kept())),
                      "\n");
    }
    for (const v1::ExcludedStatus& x : r.excluded()) {
      absl::StrAppend(&out, "  excluded: ", printable(x.node_id()), " on ", printable(x.host()),
                      absl::StrFormat(" (%.1fx, ", x.slowdown()), printable(x.cause()), "), ",
                      x.times(), x.times() == 1 ? " time" : " times",
                      x.left_ms() > 0
                          ? absl::StrCat(", out for ", human_duration(x.left_ms()), " more")
                          : std::string(", may join again"),
                      "\n");
    }
  }
  return out;
}

std::string event_json(const rendezvous::RunEvent& e, std::chrono::system_clock::time_point wall,
                       std::optional<std::uint64_t> seq) {
  JsonObject j;
  if (seq) j.add("seq", static_cast<long long>(*seq));
  // The fields every line has, in the order of launch's agent-side log (a file may hold both).
  j.add("event", rendezvous::event_name(e.kind))
      .add("time", iso8601_ms(wall))
      .add("unix_ms", static_cast<long long>(unix_ms(wall)))
      .add("source", "server")
      .add("run", e.run_id)
      .add("round", e.round)
      .add("restart_count", e.restart_count);
  auto node = [&] {
    if (!e.node_id.empty()) j.add("node", e.node_id);
    if (!e.host.empty()) j.add("host", e.host);
  };
  switch (e.kind) {
    case Kind::kNodeJoined:
      node();
      break;
    case Kind::kNodeLost:
      node();
      j.add("cause", e.cause).add("member", e.member);
      break;
    case Kind::kRoundFormed:
      j.add("nodes", e.nodes).add("world_size", e.world_size).add("spares", e.spares);
      if (e.round > 1) {
        j.add("took_ms", static_cast<long long>(e.took.count())).add("in_place", e.in_place);
      }
      break;
    case Kind::kWorkerFailed:
      node();
      j.add("rank", e.rank);
      if (e.signal > 0) {
        j.add("signal", e.signal);
      } else {
        j.add("exit_code", e.exit_code);
      }
      break;
    case Kind::kRestart:
      j.add("cause", e.cause).add("counts", e.counts).add("reason", e.reason);
      break;
    case Kind::kSucceeded:
      break;
    case Kind::kFailed:
      j.add("cause", e.cause).add("reason", e.reason);
      break;
    case Kind::kRunRestored:  // docs/rendezvous.md, "Restarting the server without ..."
      j.add("held", e.detached);
      break;
    case Kind::kNodeReattached:
      node();
      j.add("still_detached", e.detached);
      break;
    case Kind::kInPlaceResumed:  // docs/in_place.md
      node();
      j.add("resumed", e.resumed)
          .add("in_place", e.in_place)
          .add("took_ms", static_cast<long long>(e.took.count()))
          .add("abort_ms", static_cast<long long>(e.abort.count()))
          .add("rendezvous_ms", static_cast<long long>(e.rendezvous.count()))
          .add("reform_ms", static_cast<long long>(e.reform.count()));
      break;
    case Kind::kInPlaceFallback:
      node();
      j.add("reason", e.reason);
      break;
    case Kind::kStragglerNamed:  // docs/stragglers.md
    case Kind::kStragglerCleared:
    case Kind::kStragglerExcluded:
      node();
      j.add("rank", e.rank)
          .add("cause", e.cause)
          .add("slowdown", e.slowdown)
          .add("step", static_cast<long long>(e.step))
          .add("reason", e.reason);
      if (e.kind == Kind::kStragglerExcluded) {
        j.add("cooldown_ms", static_cast<long long>(e.cooldown.count())).add("times", e.times_excluded);
      }
      break;
  }
  return j.str();
}

}  // namespace muster::status
