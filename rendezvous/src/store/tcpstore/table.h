// One TCPStore-protocol store's table and its semantics (tcpstore_server.h has the rules: torch's
// own server's), apart from how its clients reach it: a socket of TcpStoreServer's, or a
// connection an agent relays over its gRPC stream (relay_service.h). The table answers each
// query into its connection's `out` and tells the connection when to send or to close; the
// front end owns sockets, streams and threads. Single-threaded: one loop serves a table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/tcpstore_protocol.h"
#include "muster/rendezvous/kv_table.h"
#include "muster/rendezvous/store.h"

namespace muster::rendezvous::tcpstore {

// A client that answers reads of the keys its own connections SET itself (an agent's relay
// for its node's workers, store_relay.h): the table tells it when another connection writes
// such a key, before any reply that could follow from that write (the caller keeps the order).
class KeyHolder {
 public:
  virtual ~KeyHolder() = default;
  // `key` of the world `round` was written by another client (or deleted, or written by a
  // query whose result the holder cannot know): its copy is no longer the table's value.
  virtual void dropped(int round, const std::string& key) = 0;
};

// A client connection as the table sees it.
class Conn : public std::enable_shared_from_this<Conn> {
 public:
  virtual ~Conn() = default;
  // `out` has replies that no serve() of this connection will send: a woken WAIT, a watched
  // key's change.
  virtual void flush() = 0;
  // Closes the connection for something it did (a limit, a bad query), with the log line the
  // protocol cannot send it.
  virtual void fail(const std::string& why) = 0;
  // Closes the connection for something that ends many at once (its world closed), telling
  // the client `why` where the protocol can; the caller logs one line for all of them.
  virtual void end(const std::string& why) { fail(why); }

  Dialect dialect = Dialect::kUnknown;
  std::string out;  // replies not yet handed on
  bool closed = false;
  // A parked WAIT: the keys still missing (a key named twice counts once per name).
  std::size_t awaited = 0;
  std::vector<std::string> wait_keys;
  // Relayed connections: the key whose value goes with this connection's next STOP_WAITING
  // (torch's get() is a WAIT then a GET of the same key: the agent answers the GET itself).
  std::optional<std::string> prefetch;
  std::optional<std::string> prefetched;  // set with that STOP_WAITING
  // Queries answered (a WATCH_KEY's later updates are not answers): a relay tells its agent.
  std::uint32_t replies = 0;
  // Relayed connections of an agent that keeps what its node SETs (null: none does).
  std::weak_ptr<KeyHolder> holder;
};
using ConnPtr = std::shared_ptr<Conn>;

class Table {
 public:
  // `round`: the world's, for what it tells a KeyHolder.
  Table(const StoreLimits& limits, std::size_t max_waits, int round = 0)
      : limits_(limits), table_(limits), max_waits_(max_waits), round_(round) {}

  // One query of `c`, answered into c->out (nothing for the SET-like queries). The caller
  // sends c->out afterwards; a query that breaks a limit calls c->fail().
  void serve(const ConnPtr& c, Request& r);
  // Takes c's parked WAIT out (CANCEL_WAIT, or the connection went).
  void unpark(Conn& c);

  std::size_t keys() const { return table_.size(); }
  std::size_t parked_waits() const { return n_waits_; }
  std::size_t held_keys() const { return held_.size(); }

 private:
  std::string old_value(const std::string& key, const std::string* before) const;
  void compare_set(const ConnPtr& c, const Request& r);
  void add(const ConnPtr& c, const Request& r);
  void erase(const ConnPtr& c, const std::string& key);
  void queue(const ConnPtr& c, Request& r);
  void set(const ConnPtr& c, const std::string& key, std::string value, std::uint8_t kind);
  bool present(const std::vector<std::string>& keys) const;
  void wait(const ConnPtr& c, const std::vector<std::string>& keys);
  void stop_waiting(Conn& c);
  void wake(const std::string& key, bool one);
  // c writes `key`: the key's holder (another client's agent) is told; c's agent holds it next
  // when `keeps` (a SET: its agent knows the value) and it keeps what it sets.
  void wrote(const Conn& c, const std::string& key, bool keeps);
  void changed(const std::string& key, std::uint8_t kind, const std::string& old,
               const std::string& now);

  StoreLimits limits_;
  KvTable table_;
  std::size_t max_waits_;
  int round_;
  // Per key, the agent whose node set it last and answers reads of it (KeyHolder). One holder
  // a key: another node's read goes to the table.
  std::unordered_map<std::string, std::weak_ptr<KeyHolder>> held_;
  std::unordered_map<std::string, std::deque<std::weak_ptr<Conn>>> waiters_;
  std::unordered_map<std::string, std::vector<std::weak_ptr<Conn>>> watchers_;
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  std::size_t queue_bytes_ = 0;
  std::size_t n_waits_ = 0;
};

}  // namespace muster::rendezvous::tcpstore
