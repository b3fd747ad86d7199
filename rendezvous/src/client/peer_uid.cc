#include "client/peer_uid.h"

#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace muster::rendezvous {

PeerUid::~PeerUid() {
  if (fd_ >= 0) ::close(fd_);
}

// The same answer from /proc/net/tcp (a kernel whose sock_diag is not there): the line whose
// local address is `peer` and remote address `local` (hex, as the kernel prints them).
absl::StatusOr<uid_t> PeerUid::owner_in_proc(const sockaddr_in& peer, const sockaddr_in& local) {
  char want_local[32], want_remote[32];
  std::snprintf(want_local, sizeof want_local, "%08X:%04X", peer.sin_addr.s_addr,
                ntohs(peer.sin_port));
  std::snprintf(want_remote, sizeof want_remote, "%08X:%04X", local.sin_addr.s_addr,
                ntohs(local.sin_port));
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string sl, l, r, st, queues, timer, retr;
    long uid = -1;
    f >> sl >> l >> r >> st >> queues >> timer >> retr >> uid;
    if (l == want_local && r == want_remote && uid >= 0) return static_cast<uid_t>(uid);
  }
  return absl::NotFoundError("the connection's socket is not in /proc/net/tcp");
}

absl::StatusOr<uid_t> PeerUid::owner(const sockaddr_in& peer, const sockaddr_in& local) {
  if (fd_ < 0 && !no_diag_) {
    fd_ = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    no_diag_ = fd_ < 0;
  }
  if (no_diag_) return owner_in_proc(peer, local);
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg{};
  msg.nlh.nlmsg_len = sizeof msg;
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;
  msg.req.sdiag_family = AF_INET;
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0U;
  msg.req.id.idiag_sport = peer.sin_port;
  msg.req.id.idiag_dport = local.sin_port;
  msg.req.id.idiag_src[0] = peer.sin_addr.s_addr;
  msg.req.id.idiag_dst[0] = local.sin_addr.s_addr;
  msg.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd_, &msg, sizeof msg, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) < 0) {
    return absl::UnavailableError(std::string("sock_diag: ") + std::strerror(errno));
  }
  alignas(nlmsghdr) char buf[8192];
  const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
  if (n < 0) return absl::UnavailableError(std::string("sock_diag: ") + std::strerror(errno));
  auto* h = reinterpret_cast<nlmsghdr*>(buf);
  if (!NLMSG_OK(h, static_cast<unsigned>(n))) return absl::UnavailableError("sock_diag: short reply");
  if (h->nlmsg_type == NLMSG_ERROR) {
    const auto* e = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
    return absl::NotFoundError(std::string("sock_diag: ") + std::strerror(-e->error));
  }
  if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) return absl::UnavailableError("sock_diag: odd reply");
  return static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid;
}

}  // namespace muster::rendezvous
