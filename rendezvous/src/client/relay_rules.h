// The store relay's per-world rules that need no socket (store_relay.h; docs/store.md): what a
// node's own writes let it answer here, how its ADDs of one key combine and what each gets
// back, when the writes held back go up, whose WAIT rides on whose, and whose connection is
// let in. Pure: no sockets, no stream, no clock (the caller says when). Private to
// client/store_relay*.cc; unit-tested in tests/unit/relay_rules_test.cc.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
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

// The owner check (StoreRelayOptions::same_user_only): a worker's connection is let in only
// when it is IPv4 and the kernel named its owner (PeerUid, peer_uid.h), the relay's own user.
enum class Owner { kMine, kNotIpv4, kUnknown, kOtherUser };
inline Owner owner_check(bool ipv4, const absl::StatusOr<uid_t>& owner, uid_t self) {
  if (!ipv4) return Owner::kNotIpv4;
  if (!owner.ok()) return Owner::kUnknown;
  return *owner == self ? Owner::kMine : Owner::kOtherUser;
}

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

// ADDs of one key from a node's connections, combined into one ADD of their sum: while a
// key's combined ADD is at the server (flying), the next ones gather behind it; the flying
// ADDs go on one connection, so the server answers them in the order they went. A launch is
// posted (queued) rather than sent at once, so that the ADDs a burst of readable sockets
// brings go up as one. `M` names a connection (the relay's LocalPtr; a number in the tests).
template <typename M>
class AddCombiner {
 public:
  // m's ADD of `delta` to `key` joins the key's next batch. True: the caller posts a launch of
  // the key (none was queued and none flies); it is queued until launch(key).
  bool join(const std::string& key, M m, std::int64_t delta) {
    Adder& a = adders_[key];
    a.next.members.emplace_back(std::move(m), delta);
    a.next.sum += static_cast<std::uint64_t>(delta);
    if (a.flies || a.queued) return false;
    a.queued = true;
    return true;
  }

  // The key's next batch goes up now, as an ADD of the returned sum (it flies until its
  // answer), when `can_send` (the stream is there) and none of the key flies; none otherwise.
  // Either way the key's launch is no longer queued.
  std::optional<std::int64_t> launch(const std::string& key, bool can_send) {
    auto it = adders_.find(key);
    if (it == adders_.end()) return std::nullopt;
    Adder& a = it->second;
    a.queued = false;
    if (a.flies || a.next.members.empty() || !can_send) return std::nullopt;
    a.flying = std::exchange(a.next, {});
    a.flies = true;
    order_.push_back(key);
    return static_cast<std::int64_t>(a.flying.sum);
  }

  // How many connections the key's flying batch holds (0: none flies).
  std::size_t flying_members(const std::string& key) const {
    auto it = adders_.find(key);
    return it == adders_.end() || !it->second.flies ? 0 : it->second.flying.members.size();
  }

  // The server answered the oldest flying ADD with `total`: its members, each with what it
  // would have had alone (combined_answers), and whether the key's next batch is to go up now
  // (the caller calls launch(key)). None when nothing flies.
  struct Answered {
    std::string key;
    std::vector<std::pair<M, std::int64_t>> each;
    bool launch_next = false;
  };
  std::optional<Answered> answer(std::int64_t total) {
    if (order_.empty()) return std::nullopt;
    Answered r;
    r.key = std::move(order_.front());
    order_.pop_front();
    auto it = adders_.find(r.key);
    if (it == adders_.end()) return r;
    Adder& a = it->second;
    a.flies = false;
    Batch b = std::exchange(a.flying, {});
    std::vector<std::int64_t> deltas;
    deltas.reserve(b.members.size());
    for (const auto& [m, delta] : b.members) deltas.push_back(delta);
    const std::vector<std::int64_t> each = combined_answers(total, deltas);
    for (std::size_t i = 0; i < b.members.size(); ++i) {
      r.each.emplace_back(std::move(b.members[i].first), each[i]);
    }
    r.launch_next = !a.next.members.empty();
    if (!r.launch_next && !a.queued) adders_.erase(it);
    return r;
  }

  // The server failed the oldest flying ADD (it served none after it): its members are lost;
  // the later ones go again in their order (resend(), on a new connection). `relaunch`: the
  // failed key's next batch waits with no launch queued (the caller posts one; it is queued).
  struct Failed {
    std::vector<M> lost;
    std::optional<std::string> relaunch;
  };
  Failed first_failed() {
    Failed f;
    if (order_.empty()) return f;
    const std::string key = std::move(order_.front());
    order_.pop_front();
    auto it = adders_.find(key);
    if (it == adders_.end()) return f;
    Adder& a = it->second;
    a.flies = false;
    for (auto& [m, delta] : std::exchange(a.flying, {}).members) f.lost.push_back(std::move(m));
    if (!a.next.members.empty() && !a.queued) {
      a.queued = true;
      f.relaunch = key;
    } else if (a.next.members.empty() && !a.queued) {
      adders_.erase(it);
    }
    return f;
  }
  // The ADDs flying, in the order they went (and their answers come): key and sum.
  std::vector<std::pair<std::string, std::int64_t>> resend() const {
    std::vector<std::pair<std::string, std::int64_t>> r;
    for (const std::string& key : order_) {
      r.emplace_back(key, static_cast<std::int64_t>(adders_.at(key).flying.sum));
    }
    return r;
  }

  // The stream to the server was lost: every flying ADD's members are lost (whether the
  // server applied it cannot be known).
  std::vector<M> lose_flying() {
    std::vector<M> lost;
    order_.clear();
    for (auto it = adders_.begin(); it != adders_.end();) {
      Adder& a = it->second;
      if (a.flies) {
        a.flies = false;
        for (auto& [m, delta] : std::exchange(a.flying, {}).members) lost.push_back(std::move(m));
      }
      if (a.next.members.empty() && !a.queued) {
        it = adders_.erase(it);
      } else {
        ++it;
      }
    }
    return lost;
  }
  // A new stream: the keys whose next batch waits with no launch queued (the caller posts
  // one for each; they are queued).
  std::vector<std::string> unlaunched() {
    std::vector<std::string> keys;
    for (auto& [key, a] : adders_) {
      if (a.next.members.empty() || a.queued || a.flies) continue;
      a.queued = true;
      keys.push_back(key);
    }
    return keys;
  }

  std::size_t keys() const { return adders_.size(); }
  bool flying() const { return !order_.empty(); }

 private:
  struct Batch {
    std::vector<std::pair<M, std::int64_t>> members;  // in the order they came
    std::uint64_t sum = 0;                            // wraps as the server's sum does
  };
  struct Adder {
    Batch flying;  // sent, not yet answered
    Batch next;    // the next one
    bool flies = false;
    bool queued = false;  // a launch is posted
  };
  std::unordered_map<std::string, Adder> adders_;
  std::deque<std::string> order_;  // the keys of the flying ADDs, in the order they went
};

}  // namespace muster::rendezvous::relay
