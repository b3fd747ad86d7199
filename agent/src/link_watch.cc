#include "muster/agent/link_watch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"

namespace muster::agent {

namespace {

// The socket inodes of `pids`' open descriptors ("socket:[N]").
std::set<std::uint64_t> socket_inodes(const std::vector<pid_t>& pids) {
  std::set<std::uint64_t> out;
  for (pid_t pid : pids) {
    const std::string dir = absl::StrCat("/proc/", pid, "/fd");
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) continue;
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char link[64];
      const std::string path = absl::StrCat(dir, "/", e->d_name);
      const ssize_t n = ::readlink(path.c_str(), link, sizeof(link) - 1);
      if (n <= 0) continue;
      absl::string_view s(link, static_cast<std::size_t>(n));
      if (!absl::ConsumePrefix(&s, "socket:[") || !absl::ConsumeSuffix(&s, "]")) continue;
      std::uint64_t inode = 0;
      if (absl::SimpleAtoi(s, &inode)) out.insert(inode);
    }
    ::closedir(d);
  }
  return out;
}

std::string address(int family, const std::uint32_t* a) {
  char buf[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(family, a, buf, sizeof buf);
  return buf;
}

bool loopback(int family, const std::uint32_t* a) {
  if (family == AF_INET) return (ntohl(a[0]) >> 24) == 127;
  static const std::uint32_t lo6[4] = {0, 0, 0, htonl(1)};
  // ::1, or an IPv4-mapped 127.x address
  return std::memcmp(a, lo6, 16) == 0 ||
         (a[0] == 0 && a[1] == 0 && a[2] == htonl(0xffff) && (ntohl(a[3]) >> 24) == 127);
}

// Every established TCP connection of this network namespace in `family`, with its tcp_info,
// handed to `each` (NETLINK_SOCK_DIAG, one dump).
void dump_tcp(int fd, int family,
              const std::function<void(const inet_diag_msg&, const tcp_info&)>& each) {
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg{};
  msg.nlh.nlmsg_len = sizeof msg;
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  msg.req.sdiag_family = static_cast<std::uint8_t>(family);
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = 1U << 1;  // TCP_ESTABLISHED
  msg.req.idiag_ext = 1U << (INET_DIAG_INFO - 1);
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd, &msg, sizeof msg, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) < 0) {
    return;
  }
  alignas(nlmsghdr) char buf[32768];
  while (true) {
    const ssize_t got = ::recv(fd, buf, sizeof buf, 0);
    if (got <= 0) return;
    int left = static_cast<int>(got);
    for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
      if (h->nlmsg_type == NLMSG_DONE || h->nlmsg_type == NLMSG_ERROR) return;
      const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
      int len = static_cast<int>(h->nlmsg_len - NLMSG_LENGTH(sizeof(*m)));
      for (auto* a = reinterpret_cast<rtattr*>(const_cast<inet_diag_msg*>(m) + 1); RTA_OK(a, len);
           a = RTA_NEXT(a, len)) {
        if (a->rta_type != INET_DIAG_INFO) continue;
        tcp_info info{};
        std::memcpy(&info, RTA_DATA(a), std::min<std::size_t>(RTA_PAYLOAD(a), sizeof info));
        each(*m, info);
      }
    }
  }
}

}  // namespace

LinkWatch::~LinkWatch() {
  if (fd_ >= 0) ::close(fd_);
}

void LinkRates::observe(std::uint64_t inode, const std::string& local, const std::string& remote,
                        std::uint64_t acked, std::uint64_t busy_us) {
  const Seen s{acked, busy_us};
  now_[inode] = s;
  auto prev = seen_.find(inode);
  // New, or its counters went back (another socket on a reused inode), or not busy since.
  if (prev == seen_.end() || s.acked < prev->second.acked || s.busy_us <= prev->second.busy_us) {
    return;
  }
  const std::uint64_t bytes = s.acked - prev->second.acked;
  if (bytes < kMinLinkBytes) return;
  const double mbps =
      static_cast<double>(bytes) / static_cast<double>(s.busy_us - prev->second.busy_us);
  double& b = best_[std::make_pair(local, remote)];
  b = std::max(b, mbps);
}

std::vector<v1::LinkRate> LinkRates::finish() {
  std::vector<v1::LinkRate> out;
  for (const auto& [key, mbps] : best_) {
    v1::LinkRate r;
    r.set_local(key.first);
    r.set_remote(key.second);
    r.set_mbps(mbps);
    out.push_back(std::move(r));
  }
  seen_ = std::move(now_);
  now_.clear();
  best_.clear();
  return out;
}

std::vector<v1::LinkRate> LinkWatch::sample(const std::vector<pid_t>& pids) {
  const std::set<std::uint64_t> inodes = socket_inodes(pids);
  if (inodes.empty()) return {};
  if (fd_ < 0) fd_ = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd_ < 0) return {};
  for (int family : {AF_INET, AF_INET6}) {
    dump_tcp(fd_, family, [&](const inet_diag_msg& m, const tcp_info& info) {
      if (inodes.count(m.idiag_inode) == 0 || loopback(m.idiag_family, m.id.idiag_dst)) return;
      rates_.observe(m.idiag_inode, address(m.idiag_family, m.id.idiag_src),
                     address(m.idiag_family, m.id.idiag_dst), info.tcpi_bytes_acked,
                     info.tcpi_busy_time);
    });
  }
  return rates_.finish();
}

}  // namespace muster::agent
