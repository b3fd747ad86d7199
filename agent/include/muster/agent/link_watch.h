// How fast this node's workers move data to other hosts (docs/stragglers.md, "Slow links"):
// the straggler watch's measure of a slow link while the job runs.
//
// The kernel keeps, per TCP connection, the bytes the peer acknowledged and the time the
// connection was busy sending (tcp_info's tcpi_bytes_acked and tcpi_busy_time): their ratio
// is the rate the link took data at while there was data to send, whatever the program's
// pauses between collectives. Each sample finds the workers' sockets (/proc/PID/fd), asks the
// kernel for every TCP connection of this network namespace with its tcp_info
// (NETLINK_SOCK_DIAG, one dump per family), keeps those of the workers to a non-loopback
// address, and reports per pair of addresses the best rate of a connection that moved at
// least kMinLinkBytes since the last sample. Not thread-safe: one sampler, one thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "muster/v1/rendezvous.pb.h"

namespace muster::agent {

// A connection must have moved this much since the last sample for its rate to count: a few
// small messages measure the round trip, not the link.
inline constexpr std::uint64_t kMinLinkBytes = 256 * 1024;

// The rate rule, pure (no kernel, no clock): fed each sample's connections, it keeps what
// each connection had acknowledged and been busy for, and gives per pair of addresses the best
// rate of a connection that moved at least kMinLinkBytes since the sample before.
class LinkRates {
 public:
  // One connection of this sample: its socket inode, its addresses, and the kernel's counters.
  void observe(std::uint64_t inode, const std::string& local, const std::string& remote,
               std::uint64_t acked, std::uint64_t busy_us);
  // The sample's rates (bytes per microsecond: MB/s), by pair of addresses; the connections
  // not observed in it are forgotten.
  std::vector<v1::LinkRate> finish();

 private:
  struct Seen {
    std::uint64_t acked = 0;
    std::uint64_t busy_us = 0;
  };
  std::map<std::uint64_t, Seen> seen_;  // by socket inode: the sample before
  std::map<std::uint64_t, Seen> now_;   // this sample's
  std::map<std::pair<std::string, std::string>, double> best_;
};

class LinkWatch {
 public:
  LinkWatch() = default;
  ~LinkWatch();
  LinkWatch(const LinkWatch&) = delete;
  LinkWatch& operator=(const LinkWatch&) = delete;

  // The rates since the last call, for the sockets of `pids`; empty when none moved enough
  // (or the kernel gives no tcp_info).
  std::vector<v1::LinkRate> sample(const std::vector<pid_t>& pids);

 private:
  int fd_ = -1;
  LinkRates rates_;
};

}  // namespace muster::agent
