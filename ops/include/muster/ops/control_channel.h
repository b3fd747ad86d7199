// The control channel between an agent and each of its workers (docs/in_place.md): one
// SOCK_SEQPACKET socket pair per worker, the worker's end named by MUSTER_CONTROL_FD. One
// message per packet, as text: a kind, then `key=value` fields separated by spaces (values
// hold no spaces or newlines). The agent writes it (agent/worker_group.cc); the worker runtime
// reads it (worker_runtime/control.h). Both sides parse with parse_control and reject what
// they do not understand, so neither trusts the other's bytes.
//
//   worker -> agent
//     hello in_place=1           this worker re-forms in place (it listens for what follows)
//     resumed round=R            it completed a step in round R's world
//     hello spare=1              this program can be started as a warm spare (launch
//                                --spares): it waits for `take` before it reads its rank
//                                (muster_inplace.await_rank); from a spare: it is ready
//   agent -> worker
//     abort round=R              the world of round R-1 is over: fail every pending and
//                                future collective now (R: the round coming, 0: not yet known)
//     world round=R rank=.. world_size=.. local_rank=.. local_world_size=.. group_rank=..
//           group_world_size=.. restart_count=.. master_addr=.. master_port=.. [lost=a,b,..]
//                                the next world: re-form in it, then answer `resumed round=R`;
//                                `lost`: the global ranks of the round before whose nodes
//                                left it (absent: none, or not known)
//     take NAME=VALUE ...        to a ready spare only: from now on it is the worker these
//                                environment variables describe (the ones that differ from
//                                the spare's own; MUSTER_SPARE goes); it then runs as a new
//                                process of that rank would
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace muster::ops::control {

// The largest message either side sends or accepts (a world message is about 200 bytes).
inline constexpr std::size_t kMaxMessageBytes = 1024;

inline constexpr char kHello[] = "hello";
inline constexpr char kResumed[] = "resumed";
inline constexpr char kAbort[] = "abort";
inline constexpr char kWorld[] = "world";
inline constexpr char kTake[] = "take";

struct Message {
  std::string kind;
  std::map<std::string, std::string> fields;

  // The field as an integer; nullopt when it is absent or not a decimal integer.
  std::optional<long long> number(const std::string& key) const;
  std::string text(const std::string& key) const;  // "" when absent
};

// "kind k=v k=v". Keys and values must be non-empty printable ASCII without spaces or '='
// (keys) and without spaces (values); encode drops a field that breaks the rule.
std::string encode(const Message& m);
// nullopt for an empty message, one over kMaxMessageBytes, a kind or field that is not
// printable ASCII, or a field without '='.
std::optional<Message> parse(std::string_view bytes);

}  // namespace muster::ops::control
