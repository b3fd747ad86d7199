// The store relay's per-world rules that need no socket (store_relay.h; docs/store.md): what a
// node's own writes let it answer here, what a combined ADD's members each get back, when
// the writes held back go up, and whose WAIT rides on whose. Pure: no sockets, no stream, no clock (the caller says when).
// Private to client/store_relay*.cc; unit-tested in tests/unit/relay_rules_test.cc.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
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
  // `key` is `value` (kept when `caching` and it fits, else forgotten).
  void keep(const std::string& key, const std::string& value, bool caching);
  // `key`'s value is not known here any more (another node wrote it, or a write of ours).
  void forget(const std::string& key);
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


// WAITs of a node's connections for the same keys: the first one's (the leader's) goes up, the
// others ride on it (followers) and are answered with it. `M` names a connection (the relay's
// LocalPtr; a number in the tests): hashable, compared by value.
template <typename M>
class WaitGroups {
 public:
  // A group's name: its keys, each with its length (["a:b"] is not ["a", "b"]).
  static std::string name_of(const std::vector<std::string>& keys) {
    std::string name;
    for (const std::string& k : keys) name += std::to_string(k.size()) + ":" + k;
    return name;
  }

  // Whether a WAIT for `keys` can ride on one at the server now.
  bool has(const std::vector<std::string>& keys) const { return groups_.count(name_of(keys)) != 0; }
  // Asked for every frame a worker sends: no hashing while no WAIT is shared.
  bool leads(const M& m) const { return !leads_.empty() && leads_.count(m) != 0; }
  bool follows(const M& m) const { return !follows_.empty() && follows_.count(m) != 0; }
  std::size_t size() const { return groups_.size(); }

  // m's WAIT for `keys` went up: it leads a group that others may ride on. False (it leads
  // none) when a group for those keys is there already or m leads one.
  bool lead(const M& m, const std::vector<std::string>& keys) {
    if (leads(m)) return false;
    auto [g, made] = groups_.try_emplace(name_of(keys));
    if (!made) return false;
    g->second.keys = keys;
    g->second.leader = m;
    leads_[m] = g->first;
    return true;
  }
  // m's WAIT for `keys` rides on the group's (has(keys) must hold).
  void follow(const M& m, const std::vector<std::string>& keys) {
    auto g = groups_.find(name_of(keys));
    if (g == groups_.end() || leads(m) || follows(m)) return;
    slot_[m] = g->second.followers.size();
    g->second.followers.push_back(m);
    follows_[m] = g->first;
  }

  // The leader m's WAIT was answered: its group ends, and each follower is to be answered
  // too. None when m leads no group.
  struct Ended {
    std::vector<std::string> keys;
    std::vector<M> followers;
  };
  std::optional<Ended> answered(const M& m) {
    auto l = leads_.find(m);
    if (l == leads_.end()) return std::nullopt;
    auto g = groups_.find(l->second);
    leads_.erase(l);
    Ended e{std::move(g->second.keys), std::move(g->second.followers)};
    groups_.erase(g);
    for (const M& f : e.followers) {
      follows_.erase(f);
      slot_.erase(f);
    }
    return e;
  }

  // The leader m goes, cancels its WAIT or sends more: the last follower leads in its place
  // and must send its own WAIT for `keys`. None when m leads no group, or the group ends
  // (no followers, or `closing`: its connections are being closed).
  struct Next {
    M leader;
    std::vector<std::string> keys;
  };
  std::optional<Next> hand_on(const M& m, bool closing) {
    auto l = leads_.find(m);
    if (l == leads_.end()) return std::nullopt;
    auto g = groups_.find(l->second);
    leads_.erase(l);
    Group& group = g->second;
    if (group.followers.empty() || closing) {
      for (const M& f : group.followers) {
        follows_.erase(f);
        slot_.erase(f);
      }
      groups_.erase(g);
      return std::nullopt;
    }
    M next = std::move(group.followers.back());
    group.followers.pop_back();
    follows_.erase(next);
    slot_.erase(next);
    group.leader = next;
    leads_[next] = g->first;
    return Next{std::move(next), group.keys};
  }

  // The follower m goes or asks for itself (it sends more): out of its group. Its keys (for
  // its own WAIT) when it followed one.
  std::optional<std::vector<std::string>> leave(const M& m) {
    auto f = follows_.find(m);
    if (f == follows_.end()) return std::nullopt;
    auto g = groups_.find(f->second);
    follows_.erase(f);
    const std::size_t at = slot_[m];
    slot_.erase(m);
    std::vector<M>& fs = g->second.followers;
    if (at < fs.size() && fs[at] == m) {  // swapped with the last: no shift of the others
      fs[at] = std::move(fs.back());
      fs.pop_back();
      if (at < fs.size()) slot_[fs[at]] = at;
    }
    return g->second.keys;
  }

 private:
  struct Group {
    std::vector<std::string> keys;
    M leader;
    std::vector<M> followers;
  };
  std::unordered_map<std::string, Group> groups_;  // by name_of(keys)
  std::unordered_map<M, std::string> leads_, follows_;  // a connection's group
  std::unordered_map<M, std::size_t> slot_;  // a follower's place in its group's followers
};

}  // namespace muster::rendezvous::relay
