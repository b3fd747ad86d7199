#include "client/peer_uid.h"

#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <sys/socket.h>
#include <sys/uio.h>
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

// The same answer from /proc/net/tcp (a kernel whose sock_diag is not there).
absl::StatusOr<uid_t> PeerUid::owner_in_proc(const sockaddr_in& peer, const sockaddr_in& local) {
  std::ifstream in("/proc/net/tcp");
  return owner_in_table(in, peer, local);
}

// The line whose local address is `peer` and remote address `local` (hex, as the kernel
// prints them).
absl::StatusOr<uid_t> PeerUid::owner_in_table(std::istream& in, const sockaddr_in& peer,
                                              const sockaddr_in& local) {
  char want_local[32], want_remote[32];
  std::snprintf(want_local, sizeof want_local, "%08X:%04X", peer.sin_addr.s_addr,
                ntohs(peer.sin_port));
  std::snprintf(want_remote, sizeof want_remote, "%08X:%04X", local.sin_addr.s_addr,
                ntohs(local.sin_port));
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

namespace {

// An exact lookup of one IPv4 TCP socket by its two ends.
struct DiagRequest {
  nlmsghdr nlh;
  inet_diag_req_v2 req;
};

DiagRequest request_for(const sockaddr_in& peer, const sockaddr_in& local, std::uint32_t seq) {
  DiagRequest msg{};
  msg.nlh.nlmsg_len = sizeof msg;
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;
  msg.nlh.nlmsg_seq = seq;
  msg.req.sdiag_family = AF_INET;
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0U;
  msg.req.id.idiag_sport = peer.sin_port;
  msg.req.id.idiag_dport = local.sin_port;
  msg.req.id.idiag_src[0] = peer.sin_addr.s_addr;
  msg.req.id.idiag_dst[0] = local.sin_addr.s_addr;
  msg.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  return msg;
}

// What one reply says: the owner, or why not.
absl::StatusOr<uid_t> read_reply(const nlmsghdr* h, std::size_t n) {
  if (!NLMSG_OK(h, static_cast<unsigned>(n))) return absl::UnavailableError("sock_diag: short reply");
  if (h->nlmsg_type == NLMSG_ERROR) {
    const auto* e = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
    return absl::NotFoundError(std::string("sock_diag: ") + std::strerror(-e->error));
  }
  if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY) return absl::UnavailableError("sock_diag: odd reply");
  return static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid;
}

}  // namespace

bool PeerUid::open() {
  if (fd_ < 0 && !no_diag_) {
    fd_ = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    no_diag_ = fd_ < 0;
  }
  return !no_diag_;
}

absl::StatusOr<uid_t> PeerUid::owner(const sockaddr_in& peer, const sockaddr_in& local) {
  if (!open()) return owner_in_proc(peer, local);
  const DiagRequest msg = request_for(peer, local, ++seq_);
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd_, &msg, sizeof msg, 0, reinterpret_cast<const sockaddr*>(&kernel),
               sizeof kernel) < 0) {
    return absl::UnavailableError(std::string("sock_diag: ") + std::strerror(errno));
  }
  alignas(nlmsghdr) char buf[8192];
  for (;;) {  // a reply left over from a batch whose answers did not all come: passed over
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0) return absl::UnavailableError(std::string("sock_diag: ") + std::strerror(errno));
    const auto* h = reinterpret_cast<const nlmsghdr*>(buf);
    if (n >= static_cast<ssize_t>(sizeof(nlmsghdr)) && h->nlmsg_seq != seq_) continue;
    return read_reply(h, static_cast<std::size_t>(n));
  }
}

std::vector<absl::StatusOr<uid_t>> PeerUid::owners(
    const std::vector<std::pair<sockaddr_in, sockaddr_in>>& conns) {
  std::vector<absl::StatusOr<uid_t>> out(conns.size(),
                                         absl::UnavailableError("sock_diag: no answer"));
  if (conns.size() <= 1 || conns.size() > kMaxBatch || !open()) {
    for (std::size_t i = 0; i < conns.size(); ++i) out[i] = owner(conns[i].first, conns[i].second);
    return out;
  }
  // One message holding every request; the kernel answers each as it reads it, before sendto
  // returns, one datagram per answer.
  const std::uint32_t first = seq_ + 1;
  std::vector<DiagRequest> reqs;
  reqs.reserve(conns.size());
  for (const auto& [peer, local] : conns) reqs.push_back(request_for(peer, local, ++seq_));
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd_, reqs.data(), reqs.size() * sizeof(DiagRequest), 0,
               reinterpret_cast<const sockaddr*>(&kernel), sizeof kernel) < 0) {
    const std::string why = std::string("sock_diag: ") + std::strerror(errno);
    for (auto& o : out) o = absl::UnavailableError(why);
    return out;
  }
  constexpr std::size_t kSlot = 1024;  // an answer is under 200 bytes
  std::vector<char> bufs(kSlot * conns.size());
  std::vector<iovec> iovs(conns.size());
  std::vector<mmsghdr> msgs(conns.size());
  std::vector<bool> got(conns.size(), false);
  for (std::size_t i = 0; i < conns.size(); ++i) {
    iovs[i] = iovec{bufs.data() + i * kSlot, kSlot};
    msgs[i].msg_hdr.msg_iov = &iovs[i];
    msgs[i].msg_hdr.msg_iovlen = 1;
  }
  const int n = ::recvmmsg(fd_, msgs.data(), static_cast<unsigned>(msgs.size()), MSG_DONTWAIT,
                           nullptr);
  for (int k = 0; k < n; ++k) {
    const auto* h = reinterpret_cast<const nlmsghdr*>(bufs.data() + static_cast<std::size_t>(k) * kSlot);
    if (msgs[k].msg_len < sizeof(nlmsghdr) || h->nlmsg_seq < first || h->nlmsg_seq > seq_) continue;
    const std::size_t i = h->nlmsg_seq - first;
    out[i] = read_reply(h, msgs[k].msg_len);
    got[i] = true;
  }
  // An answer that did not come (the socket's buffer was full): asked alone.
  for (std::size_t i = 0; i < conns.size(); ++i) {
    if (!got[i]) out[i] = owner(conns[i].first, conns[i].second);
  }
  return out;
}

}  // namespace muster::rendezvous
