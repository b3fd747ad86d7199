// What one node's workers wrote into one world's TCPStore-protocol table, kept by their agent's
// relay (store_relay.h) so that a new stream (a failover to another rdzvd, a restarted one) can
// write it again before anything else: the keys a world's workers set survive what the
// rendezvous survives. Pure.
//
// Per key, the writes since the last SET or DELETE: a SET (or MULTI_SET) or DELETE starts the
// key's list again, ADDs in a row are one ADD of their sum, APPENDs in a row one APPEND,
// COMPARE_SETs kept as they came. Replayed by every node, the sums and the sets come out as
// they were (a key set by two nodes ends with one of their values; queues are not kept).
// Bounded: past max_bytes the log stops (complete() false: said once in the log by the relay).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/tcpstore_protocol.h"

namespace muster::rendezvous::tcpstore {

class ReplayLog {
 public:
  explicit ReplayLog(std::size_t max_bytes) : max_bytes_(max_bytes) {}

  // Notes `r` if it writes (other queries are ignored).
  void note(const Request& r);
  // The writes as torch 2.x frames (a VALIDATE first), for a connection of the relay's own.
  std::vector<std::string> frames() const;
  bool empty() const { return keys_.empty(); }
  bool complete() const { return complete_; }
  std::size_t writes() const;

 private:
  struct Write {
    Op op;
    std::string a, b;  // SET/APPEND: a; COMPARE_SET: a expected, b desired
    std::int64_t delta = 0;
  };
  void add(const std::string& key, Write w);

  std::size_t max_bytes_;
  std::size_t bytes_ = 0;
  bool complete_ = true;
  std::map<std::string, std::vector<Write>> keys_;
};

}  // namespace muster::rendezvous::tcpstore
