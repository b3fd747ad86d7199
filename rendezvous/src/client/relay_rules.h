// The store relay's per-world rules that need no socket (store_relay.h; docs/store.md): what a
// node's own writes let it answer here, what a combined ADD's members each get back, and when
// the writes held back go up. Pure: no sockets, no stream, no clock (the caller says when).
// Private to client/store_relay*.cc; unit-tested in tests/unit/relay_rules_test.cc.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/tcpstore_protocol.h"

namespace muster::rendezvous::relay {

// What this node's workers SET in one world and nobody has written since, as far as the
// server has said: reads of those keys (WAIT, CHECK, GET, MULTI_GET) are answered here. At most
// `max_bytes` of keys and values; a write that does not fit forgets its key.
class WorldCache {
 public:
  explicit WorldCache(std::size_t max_bytes) : max_bytes_(max_bytes) {}

  // A write of this node: a SET's values are kept when `caching` (the relay and the server
  // agree to); any other write (ADD, APPEND, COMPARE_SET, DELETE) forgets its key: its value
  // is the server's to say.
  void remember(const tcpstore::Request& req, bool caching);
  // `key` is `value` (null: forgotten).
  void keep(const std::string& key, const std::string* value, bool caching);
  // The reply to `req` appended to `out`, when every key it reads is here; false (nothing
  // appended) when the server must answer it.
  bool answer(const tcpstore::Request& req, std::string& out) const;
  // A new server, or a write the server refused: nothing here is known any more.
  void forget_all();

  std::size_t bytes() const { return bytes_; }
  std::size_t size() const { return values_.size(); }

 private:
  const std::size_t max_bytes_;
  std::unordered_map<std::string, std::string> values_;
  std::size_t bytes_ = 0;  // keys' and values' bytes
};

// A combined ADD's answer shared out: the server answered `total` for the ADD of the members'
// `deltas` summed; each member gets what it would have had with the ADDs applied one after
// another in their order (wrapping as the server's 64-bit sum does).
std::vector<std::int64_t> combined_answers(std::int64_t total, const std::vector<std::int64_t>& deltas);

// Write-behind: a write nobody waits on (a SET) is held back and goes up with the next query
// that waits, or when due: `quiet` after the first held write if the node's workers sent
// nothing more meanwhile, `busy` after it if they did (one wake-up to find out, not one per
// pause of a busy node).
class WriteBehind {
 public:
  using Clock = std::chrono::steady_clock;
  WriteBehind(Clock::duration quiet, Clock::duration busy) : quiet_(quiet), busy_(busy) {}

  // A write was held back at `now`. True: the first since the last went up (the caller arms
  // its timer for due()).
  bool held(Clock::time_point now);
  // When what is held goes up (nothing held: none).
  std::optional<Clock::time_point> due() const;
  // The timer fired; `last_query`: when the workers last sent a query. True: send now (the
  // caller then calls sent()); false: wait on to due() (the workers were busy since).
  bool fired(Clock::time_point last_query);
  // Without the timer, as queries come: whether what is held is overdue at `last_query`.
  bool overdue(Clock::time_point last_query) const;
  // What was held went up (with a query, or sent when due): nothing waits behind.
  void sent();

  bool holding() const { return since_.has_value(); }

 private:
  const Clock::duration quiet_, busy_;
  std::optional<Clock::time_point> since_;  // the first held write's time
  bool busy_seen_ = false;                  // the workers sent more while it waited
};

}  // namespace muster::rendezvous::relay
