// Who owns the other end of a loopback TCP connection: the kernel's socket table, asked for
// that one socket (NETLINK_SOCK_DIAG, inet_diag's exact lookup), answers with its owner's uid.
// The agent's TCPStore listener (store_relay.h) lets in only its own user's workers. A kernel
// without sock_diag: the same line of /proc/net/tcp (slower: the whole table is read).
#pragma once

#include <netinet/in.h>
#include <sys/types.h>

#include <istream>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::rendezvous {

class PeerUid {
 public:
  PeerUid() = default;
  ~PeerUid();
  PeerUid(const PeerUid&) = delete;
  PeerUid& operator=(const PeerUid&) = delete;

  // The uid owning the IPv4 TCP socket whose local address is `peer` and whose remote address
  // is `local` (the accepted connection's two ends, seen from the accepting side).
  absl::StatusOr<uid_t> owner(const sockaddr_in& peer, const sockaddr_in& local);
  // The owners of several connections (peer, local) at once, each as owner() answers: one
  // message to the kernel asks for all of them and one call takes the answers (a burst of
  // workers connecting costs two system calls, not two each). Up to kMaxBatch at once; more,
  // or one, are asked one by one.
  static constexpr std::size_t kMaxBatch = 64;
  std::vector<absl::StatusOr<uid_t>> owners(
      const std::vector<std::pair<sockaddr_in, sockaddr_in>>& conns);
  // The same from /proc/net/tcp (what owner() falls back to without sock_diag).
  static absl::StatusOr<uid_t> owner_in_proc(const sockaddr_in& peer, const sockaddr_in& local);
  // The rule of that lookup, apart from the file: the uid on the line of `table` (as
  // /proc/net/tcp prints it, header first) whose local address is `peer` and remote address
  // `local`; NotFound when no line is.
  static absl::StatusOr<uid_t> owner_in_table(std::istream& table, const sockaddr_in& peer,
                                              const sockaddr_in& local);

 private:
  bool open();  // false: no sock_diag (no_diag_)

  int fd_ = -1;
  bool no_diag_ = false;  // no NETLINK_SOCK_DIAG here: /proc/net/tcp instead
  std::uint32_t seq_ = 0;  // the last request's sequence number
};

}  // namespace muster::rendezvous
